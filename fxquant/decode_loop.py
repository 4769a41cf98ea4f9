"""The decode loop behind `fxquant.generate`: one step of static buffers, captured once in a CUDA graph and replayed.

A step is the model's forward on the last token, then `Choice`: the logits processors, the next token chosen on the
device, finished sequences padded, the end-of-sequence test, every counter moved on. Nothing in it reads a value on
the host, so it replays as is. Two graphs are captured: one of a whole chunk of CHECK_EVERY steps, so that each
replay's fixed host cost (the launch, the generator's prologue) is paid once a chunk, and one of a single step for
the last, shorter chunk. The host reads the finished flags (and the tokens, for a streamer) back once per
CHECK_EVERY steps, a chunk behind the GPU, so the GPU's queue never drains; the steps run past the last
end-of-sequence give pad tokens and are cut, as generate() would never have run them.
"""

from __future__ import annotations

import dataclasses
import inspect
import time
import warnings

import torch
import transformers as T

CHECK_EVERY = 8  # steps between reads of the finished flags: at most two chunks run past the last end-of-sequence


@dataclasses.dataclass
class RunStats:
    """One model's last run: new tokens per sequence, decode steps run, the decode loop's seconds (wall_s, from the
    prefill's token on) and the host's seconds in it outside its waits for the GPU (host_s / steps: the host's share
    of a step), and whether a CUDA graph ran the steps."""
    tokens: int = 0
    steps: int = 0
    wall_s: float = 0.0
    host_s: float = 0.0
    graph: bool = False


@dataclasses.dataclass
class Choice:
    """How the next token is chosen from a step's logits: transformers' processors (pure functions of the scores),
    argmax or sampling, the end-of-sequence ids and the pad token, and whether the raw logits are kept."""
    processors: tuple
    sample: bool
    eos: torch.Tensor | None
    pad: torch.Tensor
    keep_logits: bool
    generator: torch.Generator | None

    @classmethod
    def of(cls, config, processors, criteria, generator, device) -> Choice:
        eos = [c.eos_token_id.reshape(-1) for c in criteria if isinstance(c, T.EosTokenCriteria)]
        eos = torch.cat(eos).to(device) if eos else None
        pad = config._pad_token_tensor  # generate() sets it to the first eos id when only that is given
        pad = torch.as_tensor(0 if pad is None else pad, device=device)  # used only once a sequence has ended
        keep = bool(config.return_dict_in_generate and config.output_logits)
        return cls(tuple(processors), bool(config.do_sample), eos, pad, keep, generator)

    @property
    def key(self) -> tuple:
        return (tuple((type(p).__name__, repr(vars(p))) for p in self.processors), self.sample,
                None if self.eos is None else tuple(self.eos.tolist()), int(self.pad), self.keep_logits,
                id(self.generator))

    def next_token(self, scores: torch.Tensor, placeholder: torch.Tensor) -> torch.Tensor:
        """scores: fp32 logits [B, V]. placeholder: passed as the processors' input_ids, which these never read."""
        for processor in self.processors:
            scores = processor(placeholder, scores)
        if not self.sample:
            return torch.argmax(scores, dim=-1)
        probs = torch.softmax(scores, dim=-1)
        race = torch.empty_like(probs).exponential_(generator=self.generator)
        # argmax of p / Exp(1) draws token i with probability p_i, as multinomial does, without its host sync; the
        # floor keeps a zero draw from dividing a filtered (zero) probability into NaN
        return torch.argmax(probs / race.clamp_min(torch.finfo(torch.float32).tiny), dim=-1)


def is_compiled(forward) -> bool:
    """torch.compile(model.forward), model.compile(), or a model whose forward is one of them."""
    return (getattr(forward, "_torchdynamo_orig_callable", None) is not None
            or getattr(forward, "_compiled_call_impl", None) is not None
            or getattr(getattr(forward, "forward", None), "_torchdynamo_orig_callable", None) is not None)


class Runner:
    """One batch's decode loop over one static cache: the step's static buffers, and its CUDA graph once captured.
    forwards: the prefill's and the step's. shape: (batch, new tokens), the latter sizing the kept logits."""

    def __init__(self, model, forwards, cache, shape: tuple[int, int], masked: bool, choice: Choice):
        self.model, (self.prefill, self.forward), self.cache, self.choice = model, forwards, cache, choice
        parameters = inspect.signature(model.forward).parameters
        self.keyword = "cache" if "cache" in parameters else "past_key_values"  # renamed in transformers 5
        self.takes_positions = "position_ids" in parameters
        (batch, new_tokens), device = shape, model.device
        room = max(layer.max_cache_len for layer in cache.layers)
        long = dict(dtype=torch.long, device=device)
        self.token, self.position = torch.zeros(batch, 1, **long), torch.zeros(batch, 1, **long)
        self.cache_position, self.step = torch.zeros(1, **long), torch.zeros(1, **long)
        self.produced = torch.zeros(1, **long)  # the steps generate()'s loop would have run: some sequence unfinished
        self.unfinished = torch.ones(batch, dtype=torch.bool, device=device)
        self.tokens = torch.zeros(batch, room + 1, **long)
        self.mask = torch.ones(batch, room, **long) if masked else None  # the whole cache's: the future is causal
        vocab = model.config.get_text_config().vocab_size
        self.logits = torch.zeros(batch, new_tokens, vocab, device=device) if choice.keep_logits else None
        self.use_graph = device.type == "cuda" and is_compiled(self.forward)
        self.graph, self.chunk_graph, self.stats = None, None, None

    def start(self, input_ids, mask, positions, logits_to_keep) -> None:
        """Prefills the prompt as generate() does and chooses the first new token, the counters reset."""
        self.prompt, length = input_ids, input_ids.shape[1]
        if self.mask is not None:
            self.mask.fill_(1)
            self.mask[:, :length].copy_(mask)
        self.step.zero_()
        self.produced.zero_()
        self.unfinished.fill_(True)
        self.cache_position.fill_(length)
        if self.prefill is not self.model and not all(getattr(layer, "is_initialized", True)
                                                      for layer in self.cache.layers):
            self._allocate_cache(input_ids)
        extra = {} if logits_to_keep is None else {"logits_to_keep": logits_to_keep}
        if self.takes_positions and positions is not None:
            extra["position_ids"] = positions
        out = self.prefill(input_ids=input_ids, attention_mask=None if mask is None else self.mask[:, :length],
                           cache_position=torch.arange(length, device=input_ids.device), use_cache=True,
                           **{self.keyword: self.cache}, **extra)
        last = positions[:, -1:] if positions is not None else torch.full_like(self.position, length - 1)
        self.position.copy_(last + 1)
        self._choose(out.logits[:, -1].float())

    def _allocate_cache(self, input_ids) -> None:
        """The cache's layers allocate their tensors on their first write: done by one eager token, outside the
        compiled prefill, whose graph would otherwise be traced once with the allocation and again without."""
        self.model(input_ids=input_ids[:, :1], cache_position=torch.zeros(1, dtype=torch.long, device=input_ids.device),
                   use_cache=True, **{self.keyword: self.cache})
        self.cache.reset()

    def _choose(self, logits: torch.Tensor) -> None:
        """The next token from last-position fp32 logits [B, V], written at `step`; the counters moved on."""
        if self.logits is not None:
            self.logits.index_copy_(1, self.step, logits[:, None])
        chosen = self.choice.next_token(logits, self.token)
        chosen = torch.where(self.unfinished, chosen, self.choice.pad)  # finished sequences get pad, as generate()'s
        self.produced.add_(self.unfinished.any().long())
        self.tokens.index_copy_(1, self.step, chosen[:, None])
        if self.choice.eos is not None:
            self.unfinished &= ~torch.isin(chosen, self.choice.eos)
        self.token.copy_(chosen[:, None])
        self.step.add_(1)

    def _step(self) -> None:
        positions = {"position_ids": self.position} if self.takes_positions else {}
        out = self.forward(input_ids=self.token, attention_mask=self.mask, cache_position=self.cache_position,
                           use_cache=True, **{self.keyword: self.cache}, **positions)
        self._choose(out.logits[:, -1].float())
        self.cache_position.add_(1)
        self.position.add_(1)

    def _capture(self) -> None:
        """Two real steps first (they compile, autotune, and would show a recompile), on a side stream as CUDA
        graphs ask; then one step, and a chunk of CHECK_EVERY steps, are captured, not run. The two graphs share one
        memory pool: every value a step hands the next lives in the runner's buffers and the cache, outside both."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._step()
        torch.cuda.current_stream().wait_stream(side)
        graph, chunk_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        if self.choice.generator is not None:
            graph.register_generator_state(self.choice.generator)
            chunk_graph.register_generator_state(self.choice.generator)
        try:
            with torch.cuda.graph(graph):
                self._step()
            with torch.cuda.graph(chunk_graph, pool=graph.pool()):
                for _ in range(CHECK_EVERY):
                    self._step()
        except RuntimeError as error:  # nothing ran: a capture records the step's work, it runs none of it
            self.use_graph = False
            reason = str(error).splitlines()[0].rstrip(".")
            warnings.warn(f"fxquant.generate: the decode step could not be captured in a CUDA graph, so it runs "
                          f"step by step, launched by the host: {reason}. An MoE model whose experts read their "
                          f"routing on the host does this: transformers' eager experts, and its grouped_mm experts "
                          f"in a dtype other than bf16 (which it runs as a loop under torch.compile); Fix: "
                          f"model.set_experts_implementation('grouped_mm') on a bf16 model", stacklevel=4)
            return
        self.graph, self.chunk_graph = graph, chunk_graph

    def run(self, new_tokens: int, streamer) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The decode steps after the prefill's token, in chunks of CHECK_EVERY. Each chunk's end queues a copy of
        the finished flags and of its tokens to the host; they are read one chunk later, while the next one runs.
        Returns the prompt and the new tokens, and the kept logits [B, new, V]."""
        done, sent, streamed, pending = 1, 0, 0, None  # the prefill chose the first token
        first = self.tokens[:, 0].cpu()  # one wait, for the prefill: the loop's time below is the decode's alone
        if streamer is not None:  # that token at once, as generate() streams it
            streamer.put(first)
            streamed = 1
        stats, start, waited = RunStats(), time.perf_counter(), 0.0
        while done < new_tokens:
            if self.use_graph and self.graph is None and new_tokens - done > 2:
                self._capture()
                done += 2
                continue
            chunk = min(CHECK_EVERY, new_tokens - done)
            if chunk == CHECK_EVERY and self.chunk_graph is not None:
                self.chunk_graph.replay()
            else:
                for _ in range(chunk):
                    self.graph.replay() if self.graph is not None else self._step()
            done += chunk
            readback = Readback(self.unfinished.any(), self.produced, self.tokens[:, sent:done], sent)
            sent = done
            if pending is not None:
                wait = time.perf_counter()
                pending.wait()
                waited += time.perf_counter() - wait
                streamed = pending.stream(streamer, streamed)
                if not pending.unfinished:
                    break
            pending = readback
        wait = time.perf_counter()
        produced = int(self.produced)  # waits for the GPU's last step
        waited += time.perf_counter() - wait
        stats.wall_s, stats.steps, stats.tokens = time.perf_counter() - start, done - 1, produced
        stats.graph = self.graph is not None
        stats.host_s = stats.wall_s - waited
        self.stats = stats
        if streamer is not None:
            for column in self.tokens[:, streamed:produced].cpu().unbind(1):
                streamer.put(column)
        sequences = torch.cat([self.prompt, self.tokens[:, :produced]], dim=1)
        return sequences, None if self.logits is None else self.logits[:, :produced].clone()


class Readback:
    """Copies to the host queued behind the GPU's work (the finished flag, the count of produced tokens, one chunk
    of tokens from column `first`), and the event that says they have landed."""

    def __init__(self, unfinished, produced, tokens, first: int):
        self.copies = [t.to("cpu", non_blocking=True) for t in (unfinished, produced, tokens)]
        self.first, self.event, self.unfinished = first, None, True
        if tokens.device.type == "cuda":
            self.event = torch.cuda.Event()
            self.event.record()

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()
        self.unfinished = bool(self.copies[0])

    def stream(self, streamer, streamed: int) -> int:
        """Puts the chunk's tokens that generate() would have produced; returns the columns streamed so far."""
        end = min(self.first + self.copies[2].shape[1], int(self.copies[1]))
        if streamer is not None:
            for column in self.copies[2][:, streamed - self.first:end - self.first].unbind(1):
                streamer.put(column)
        return max(streamed, end)
