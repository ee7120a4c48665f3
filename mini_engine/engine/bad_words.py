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
        sequences.append(alone)
        if spaced[0] != alone[0] and len(spaced) == len(alone):
            sequences.append(spaced)
    return sequences


def bad_word_bans(sequences: list[list[int]], output_token_ids: list[int]) -> list[int]:
    """The tokens that would complete a bad word after these output tokens."""
    n = len(output_token_ids)
    return sorted({ids[-1] for ids in sequences
                   if len(ids) - 1 <= n and output_token_ids[n - len(ids) + 1:] == ids[:-1]})
