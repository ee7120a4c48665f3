"""vLLM's bad_words: words the output may not contain, as token sequences. A word's last token is
banned wherever the output's last tokens are the rest of it (a one-token word, always)."""


def bad_words_token_ids(tokenizer, bad_words: list[str]) -> list[list[int]]:
    """Each word's tokens as vLLM takes them: alone, and after a space (inside text a word is
    often one token with its leading space) where that is a word of its own, another first token
    and as many tokens."""
    sequences = []
    for word in bad_words:
        alone = tokenizer.encode(word.lstrip(), add_special_tokens=False).ids
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False).ids
        if not alone or not spaced:
            raise ValueError(f"bad_words: {word!r} is no tokens to the tokenizer")
        sequences.append(alone)
        if spaced[0] != alone[0] and len(spaced) == len(alone):
            sequences.append(spaced)
    return sequences


def bad_word_bans(sequences: list[list[int]], token_ids: list[int], num_prompt_tokens: int) -> list[int]:
    """The tokens that would complete a bad word after a sequence's tokens: only its output's
    count (as vLLM's), and only their last few are read."""
    n = len(token_ids)
    return sorted({ids[-1] for ids in sequences
                   if len(ids) - 1 <= n - num_prompt_tokens and token_ids[n - len(ids) + 1:] == ids[:-1]})


def check_bad_words(sequences: list[list[int]], params, stop_token_ids: set[int]) -> None:
    """Raises ValueError where allowed_token_ids leaves nothing to sample but one-token bad words
    (and, under min_tokens, stop tokens): the argmax of a row of -inf is token 0, allowed or not."""
    if not params.allowed_token_ids:
        return
    left = set(params.allowed_token_ids) - {ids[0] for ids in sequences if len(ids) == 1}
    if not left or (params.min_tokens and left <= stop_token_ids):
        raise ValueError(f"allowed_token_ids {params.allowed_token_ids} holds only bad words"
                         f"{' and stop tokens, which min_tokens bans' if left else ''}: nothing is left to sample")
