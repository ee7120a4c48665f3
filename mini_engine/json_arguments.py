"""vLLM's JSON CLI arguments, key by key. A JSON option may be given whole or a key at a time, as
`vllm serve` takes it:

    --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'
    --speculative-config.method ngram --speculative-config.num_speculative_tokens 4

A nested key is a dotted path (`--hf-overrides.rope_scaling.factor 4.0`), `=` may join a key to its
value, and `key+ value` (or `key+=v1,v2`) appends to a list. A value is read as JSON where it is JSON
(4, true, [1, 2]), else as a string (ngram). Keys given so are merged over the option's whole JSON
where that is given too. expand_json_arguments rewrites the command line into the whole-JSON form
before argparse reads it, so the options themselves stay plain `type=json.loads` ones."""
import json


def _value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _set(tree: dict, path: list[str], value, append: bool, flag: str) -> None:
    for key in path[:-1]:
        node = tree.setdefault(key, {})
        if not isinstance(node, dict):
            raise ValueError(f"{flag}.{'.'.join(path)}: {key!r} is already given a value, not keys")
        tree = node
    key = path[-1]
    if append:
        items = tree.setdefault(key, [])
        if not isinstance(items, list):
            raise ValueError(f"{flag}.{'.'.join(path)}+: {key!r} is already given a value that is not a list")
        items.extend(_value(item) for item in value.split(","))
    else:
        tree[key] = _value(value)


def _merge(base: dict, keys: dict) -> dict:
    for key, value in keys.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value
    return base


def expand_json_arguments(argv: list[str], flags: dict[str, str]) -> list[str]:
    """argv with every JSON option given key by key turned into one whole-JSON argument. flags:
    each option string of a JSON option ("--compilation-config", "-cc", ...) to the option's long
    flag. Raises ValueError, for the parser to report, on a key without a value or keys given
    beside a whole value that is not a JSON object. (The parser must not take abbreviated flags,
    which this would not know for the option's.)"""
    keys: dict[str, dict] = {}                  # long flag -> the keys given one by one
    whole: dict[str, tuple[int, str]] = {}      # long flag -> its last whole value: (where in out, its flag)
    out, i = [], 0
    # Longest first, so that "--compilation-config." is not read as a shorter flag's key.
    ordered = sorted(flags, key=len, reverse=True)
    while i < len(argv):
        token = argv[i]
        if token == "--":                       # what follows is positional
            out += argv[i:]
            break
        keyed = next((f for f in ordered if token.startswith(f + ".")), None)
        if keyed is None:
            # A whole value: "--flag JSON", "--flag=JSON", or a short flag's value attached to it.
            flag = next((f for f in ordered if token == f or token.startswith(f + "=")
                         or (not f.startswith("--") and token.startswith(f))), None)
            if flag is not None:
                whole[flags[flag]] = (len(out), flag)
            out.append(token)
            i += 1
            continue
        path, sep, value = token[len(keyed) + 1:].partition("=")
        if not sep:
            if i + 1 >= len(argv):
                raise ValueError(f"{token}: expected a value after it")
            value, i = argv[i + 1], i + 1
        append = path.endswith("+")
        path = path.removesuffix("+").split(".")
        if not all(path):
            raise ValueError(f"{token}: a key is empty")
        _set(keys.setdefault(flags[keyed], {}), path, value, append, keyed)
        i += 1
    if not keys:
        return argv
    drop = set()
    for long_flag, given in keys.items():
        base = {}
        if long_flag in whole:      # as argparse would, the last whole value counts
            at, flag = whole[long_flag]
            token = out[at]
            drop.add(at)
            if token == flag:
                text = out[at + 1] if at + 1 < len(out) else ""
                drop.add(at + 1)
            else:
                text = token[len(flag):].removeprefix("=")
            base = _value(text)
            if not isinstance(base, dict):
                raise ValueError(f"{long_flag} is given as {text!r} and key by key: keys need a JSON object")
        keys[long_flag] = _merge(base, given)
    rest = [token for at, token in enumerate(out) if at not in drop]
    end = rest.index("--") if "--" in rest else len(rest)
    expanded = [arg for long_flag, given in keys.items() for arg in (long_flag, json.dumps(given))]
    return rest[:end] + expanded + rest[end:]
