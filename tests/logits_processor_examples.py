"""Custom logits processors the tests load by name (`tests.logits_processor_examples:TargetToken`),
in the engine's process and in a server's, each written as vLLM's documentation writes its own."""
import math

import torch

from mini_engine import AdapterLogitsProcessor, LogitsProcessor, process_dict_updates


class TargetToken(LogitsProcessor):
    """vLLM's example: a request whose extra_args name a target_token samples only that token."""

    @classmethod
    def validate_params(cls, params):
        target = (params.extra_args or {}).get("target_token")
        if target is not None and (not isinstance(target, int) or target < 0):
            raise ValueError(f"target_token must be a token id, got {target!r}")

    def __init__(self, config, device, is_pin_memory):
        self.targets: dict[int, int] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update) -> None:
        process_dict_updates(self.targets, batch_update,
                             lambda params, prompt_ids, output_ids: (params.extra_args or {}).get("target_token"))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.targets:
            return logits
        rows = torch.tensor(list(self.targets), device=logits.device)
        cols = torch.tensor(list(self.targets.values()), device=logits.device)
        kept = logits[rows, cols].clone()
        logits[rows] = -math.inf
        logits[rows, cols] = kept
        return logits


class FailsInApply(TargetToken):
    """Raises in apply while a request with extra_args {"fail_apply": True} is in the batch."""

    def __init__(self, config, device, is_pin_memory):
        super().__init__(config, device, is_pin_memory)
        self.failing: dict[int, bool] = {}

    def update_state(self, batch_update) -> None:
        super().update_state(batch_update)
        process_dict_updates(self.failing, batch_update, lambda params, prompt_ids, output_ids:
                             True if (params.extra_args or {}).get("fail_apply") else None)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.failing:
            raise RuntimeError("apply failed")
        return super().apply(logits)


class NoRepeat(LogitsProcessor):
    """Bans each opted-in request's newest output token, read on the host from its live output
    list: a processor that is wrong if that list is stale by a step or holds a placeholder."""

    def __init__(self, config, device, is_pin_memory):
        self.outputs: dict[int, object] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update) -> None:
        process_dict_updates(self.outputs, batch_update, lambda params, prompt_ids, output_ids:
                             output_ids if (params.extra_args or {}).get("no_repeat") else None)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, output_ids in self.outputs.items():
            if len(output_ids):
                assert output_ids[-1] >= 0, f"a placeholder in the output: {list(output_ids)}"
                logits[row, output_ids[-1]] = -math.inf
        return logits


class ScaledMinP(LogitsProcessor):
    """min_p written as a custom processor: argmax-invariant, so it is given the logits divided by
    temperature, whose softmax is the distribution the row samples from."""

    def __init__(self, config, device, is_pin_memory):
        self.min_p: dict[int, float] = {}

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update) -> None:
        process_dict_updates(self.min_p, batch_update,
                             lambda params, prompt_ids, output_ids: (params.extra_args or {}).get("scaled_min_p"))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, min_p in self.min_p.items():
            logits[row] = logits[row].masked_fill(logits[row] < logits[row].max() + math.log(min_p), -math.inf)
        return logits


class CountUp(AdapterLogitsProcessor):
    """Per-request callables through vLLM's adapter: a request with extra_args {"count_up": k}
    samples token (k + number of output tokens so far), in the two signatures vLLM accepts."""

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params):
        start = (params.extra_args or {}).get("count_up")
        if start is None:
            return None

        def force(token: int, row: torch.Tensor) -> torch.Tensor:
            forced = torch.full_like(row, -math.inf)
            forced[token] = 0.0
            return forced

        if (params.extra_args or {}).get("with_prompt"):
            return lambda prompt_ids, output_ids, row: force(start + len(prompt_ids) + len(output_ids), row)
        return lambda output_ids, row: force(start + len(output_ids), row)
