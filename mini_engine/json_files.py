"""A checkpoint folder's JSON files (config.json, generation_config.json, a Sentence Transformers
modules.json), read with one check of what their top level is, so that a malformed file is named
in the error rather than failing later on a missing method."""
import json
import os


def read_json_file(path: str, kind: type = dict, what: str = "a JSON object"):
    """The file at path, parsed; None where there is no such file. ValueError ("path: not what")
    where its top level is not a `kind`."""
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        value = json.load(f)
    if not isinstance(value, kind):
        raise ValueError(f"{path}: not {what}")
    return value
