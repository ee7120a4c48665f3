from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None       # "stop", "length", "abort", or None while running
    logprobs: list | None = None    # a SampleLogprobs per token, where SamplingParams.logprobs asked
    cumulative_logprob: float | None = None    # the sum of those logprobs, where asked (as vLLM)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None      # None for a prompt given as embeddings (it has none)
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    # Prompt tokens served by the prefix cache (at the last admission; of n completions, the most
    # any was served: the first usually computes the prompt that the others then find)
    num_cached_tokens: int = 0
    num_preemptions: int = 0        # of all its completions
    # Where SamplingParams.prompt_logprobs asked, as vLLM's: None for the first prompt token (nothing
    # comes before it), then a SampleLogprobs for each (its log-probability, rank and top ones).
    prompt_logprobs: list | None = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]          # the pooled vector (normalised, cut to dimensions, where asked)

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ScoringOutput:
    score: float                    # the cosine similarity of the pair's embeddings


@dataclass
class ScoringRequestOutput:
    """LLM.score's result for one pair, as vLLM's: its id joins the two embeddings' ids, and its
    token ids are the first text's, then the second's."""
    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = True


@dataclass
class EmbeddingRequestOutput:
    """LLM.embed's result for one prompt, as vLLM's."""
    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


@dataclass
class ClassificationOutput:
    probs: list[float]              # the labels' probabilities (the raw logits where use_activation is False)

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    """LLM.classify's result for one prompt, as vLLM's."""
    request_id: str
    prompt_token_ids: list[int]
    outputs: ClassificationOutput
    finished: bool = True


@dataclass
class PoolingOutput:
    # LLM.encode's: the task's pooled output (an embedding, probabilities); LLM.reward's: the score
    # head's logits at the prompt's last token
    data: list[float]


@dataclass
class PoolingRequestOutput:
    """LLM.encode's and LLM.reward's result for one prompt, as vLLM's (whose data is a tensor; here a list)."""
    request_id: str
    prompt_token_ids: list[int]
    outputs: PoolingOutput
    finished: bool = True
