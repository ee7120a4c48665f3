"""The penalties as their definitions state them, a token at a time: the oracle of
layers/penalties.py and of the engine's penalised outputs."""
import torch

from mini_engine.sampling_params import SamplingParams


def penalised_by_definition(logits: torch.Tensor, history: list[int], num_prompt: int, p: SamplingParams):
    """OpenAI's presence and frequency penalties, transformers' repetition penalty, a token at a time."""
    out = logits.clone()
    output = history[num_prompt:]
    for token in range(logits.shape[0]):
        value = out[token].item()
        if token in history:
            value = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
        count = output.count(token)
        value -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
        out[token] = value
    return out
