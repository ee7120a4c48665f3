"""A byte-level BPE tokenizer with Qwen3's vocabulary size, from random merges (probe only)."""
import random, time, sys
from tokenizers import Tokenizer, models, pre_tokenizers, decoders, AddedToken

def build(n=151643, seed=0):
    rng = random.Random(seed)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    alphabet.sort()
    vocab = {c: i for i, c in enumerate(alphabet)}
    toks = list(alphabet)
    merges = []
    # weight toward short tokens as real BPE
    while len(toks) < n:
        a = toks[min(int(rng.expovariate(1 / 3000)), len(toks) - 1)]
        b = toks[min(int(rng.expovariate(1 / 3000)), len(toks) - 1)]
        ab = a + b
        if len(ab) > 12 or ab in vocab:
            continue
        vocab[ab] = len(toks); toks.append(ab); merges.append((a, b))
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]])
    return tok

if __name__ == "__main__":
    t0 = time.time(); tok = build(); print("built", tok.get_vocab_size(), time.time() - t0)
    tok.save(sys.argv[1])
