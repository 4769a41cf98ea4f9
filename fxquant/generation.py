"""`fxquant.generate`: transformers' `generate()` with the host out of the decode loop.

    out = fxquant.generate(model, ids, attention_mask=mask, max_new_tokens=256, options={"recipe": "fp8_row"})
    out = model.generate(ids, custom_generate=fxquant.generate, max_new_tokens=256)    # the same loop

transformers prepares everything as its own generate() does (generation config, special tokens, the processors and
stopping criteria, left-padding checks), then calls `generate` back through its `custom_generate` hook with what it
prepared. From there:

- Without `options`, the prompt and each step run through the model as it is (eager, or however the user compiled
  it), as generate() runs them. With `options`, both are compiled with the fxquant backend (the prompt with dynamic
  shapes, one graph for every length; the step with static ones); {"include": []} quantizes nothing.
- Each decode step is one function of static buffers: the model's forward on the last token, the logits
  processors and the choice of the next token on the device (argmax, or sampling by the exponential race), the
  finished sequences padded, the end-of-sequence test, the counters moved on.
- On a GPU with a compiled forward, the step is captured once in a CUDA graph and replayed: no guards, no Python,
  no sync per token. The host reads the finished flags back once per CHECK_EVERY steps, a chunk behind the GPU, so
  the GPU's queue never drains; the few steps run past the last end-of-sequence give pad tokens and are cut.
- Elsewhere (the CPU, or a forward nobody compiled) the same step runs without a graph.

Refused by name, with model.generate as the fix: beam search, assistant models, and processors or stopping
criteria that read the growing sequence on the host (repetition penalties, min_new_tokens, stop strings, ...).
"""

from __future__ import annotations

import contextlib

import torch
import transformers as T
from transformers.cache_utils import StaticCache, StaticLayer, StaticSlidingWindowLayer
from transformers.generation.utils import GenerateDecoderOnlyOutput

from fxquant.decode_loop import Choice, Runner, RunStats
from fxquant.modules.kv_cache import E4M3_LAYERS

# Processors that are pure functions of the scores: they run inside the captured step.
ON_DEVICE = (T.TemperatureLogitsWarper, T.TopKLogitsWarper, T.TopPLogitsWarper, T.MinPLogitsWarper)
HANDLED = (T.MaxLengthCriteria, T.EosTokenCriteria)  # the step's own counters and end-of-sequence test
# A sliding layer that never fills is a full one; as a full one its fill is tracked on the device, not in a Python
# int that dynamo specializes on (one recompile per step) and a replayed graph never moves on.
FULL_LAYER = {StaticSlidingWindowLayer: StaticLayer, E4M3_LAYERS[StaticSlidingWindowLayer]: E4M3_LAYERS[StaticLayer]}
SHORTEST_CACHE = 256  # positions: the smallest cache fxquant.generate allocates; past it, powers of two
MODEL_KWARGS = {"attention_mask", "position_ids", "cache", "past_key_values", "use_cache", "logits_to_keep",
                "cache_position"}


def generate(model, input_ids: torch.Tensor, *, options: dict | None = None,
             generator: torch.Generator | None = None, streamer=None, fxquant_streamer=None, **kwargs):
    """model.generate(input_ids, **kwargs) with the decode loop on the device. kwargs are generate()'s
    (attention_mask, max_new_tokens, do_sample, temperature, top_k, top_p, eos_token_id, pad_token_id, streamer,
    past_key_values=a StaticCache or fxquant.FP8StaticCache, return_dict_in_generate with output_logits, ...).
    options: the fxquant backend's options to compile the decode step with; None runs the model as it is.
    generator: draws the samples (else torch's default generator, seeded by torch.manual_seed). Returns what
    model.generate returns: the prompt and the new tokens, finished sequences padded with pad_token_id."""
    if "generation_config" not in kwargs:  # called by the user: transformers prepares, then calls back
        if streamer is not None:  # transformers hands a custom_generate callable no streamer: it goes by our name
            streamer.put(input_ids.cpu())
        return model.generate(input_ids, custom_generate=generate, options=options, generator=generator,
                              fxquant_streamer=streamer, **kwargs)
    return _decode(model, input_ids, options, generator, streamer=streamer or fxquant_streamer, **kwargs)


class Kept:
    """What fxquant.generate keeps on a model for its next call: its static cache, the runner with the captured
    step's graph, the compiled forwards, and the last run's numbers. A copy of the model (copy.deepcopy, pickle)
    starts with none of it: a CUDA graph is neither copied nor pickled."""

    def __init__(self):
        self.caches, self.runners, self.forwards, self.stats = {}, {}, {}, None

    def __deepcopy__(self, memo):
        return Kept()

    def __reduce__(self):
        return Kept, ()


def kept(model) -> Kept:
    return model.__dict__.setdefault("_fxquant_generate", Kept())


def last_run(model) -> RunStats | None:
    """The model's last fxquant.generate run: tokens, steps, the decode loop's time and the host's share of it."""
    return kept(model).stats


def release(model) -> None:
    """Frees what fxquant.generate keeps on the model for its next call: its static cache, the captured step's graph
    and memory, and the compiled forwards."""
    model.__dict__.pop("_fxquant_generate", None)


def _refuse(what: str) -> ValueError:
    return ValueError(f"fxquant.generate: {what}. Fix: use model.generate for this")


def _decode(model, input_ids, options, generator, *, generation_config, logits_processor, stopping_criteria,
            streamer=None, synced_gpus=False, **model_kwargs):
    config = generation_config
    _check(config, logits_processor, stopping_criteria, synced_gpus, model_kwargs)
    max_length = min(c.max_length for c in stopping_criteria if isinstance(c, T.MaxLengthCriteria))
    choice = Choice.of(config, logits_processor, stopping_criteria, generator, input_ids.device)
    batch, length = input_ids.shape
    cache = _static_cache(model, model_kwargs, batch, max_length - 1)  # the last new token is never fed back
    mask = model_kwargs.get("attention_mask")
    positions = model_kwargs.get("position_ids")
    if positions is None and mask is not None:
        positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)  # as generate() counts left padding
    runner = _runner(model, options, cache, (batch, max_length - length), mask is not None, choice)
    with _compiled_or_refused(), _inductor_faults_avoided(input_ids.device):
        runner.start(input_ids, mask, positions, model_kwargs.get("logits_to_keep"))
        sequences, logits = runner.run(max_length - length, streamer)
    kept(model).stats = runner.stats
    if streamer is not None:
        streamer.end()
    if config.return_dict_in_generate:
        return GenerateDecoderOnlyOutput(sequences=sequences, logits=None if logits is None else logits.unbind(1))
    return sequences


@contextlib.contextmanager
def _compiled_or_refused():
    """A compiled forward that dynamo would run eagerly instead, its recompile limit hit (every graph of one forward
    method counts, across models and options), raises: run eagerly, the prompt or the step is not quantized."""
    try:
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            yield
    except torch._dynamo.exc.FailOnRecompileLimitHit as error:
        raise RuntimeError(
            f"fxquant.generate: dynamo's recompile limit ({torch._dynamo.config.recompile_limit}) is hit for the "
            f"model's forward (each model, options and cache length compiles it anew), and it would run "
            f"unquantized. Fix: torch._dynamo.reset() between models, one StaticCache of the longest length as "
            f"past_key_values, or raise torch._dynamo.config.recompile_limit") from error


def _inductor_faults_avoided(device: torch.device):
    """Inductor's CPU code on torch 2.11 (not 2.13 or 2.14; 2.12 not tried) checks an index against its bound before
    it defines the index, in transformers' padding mask over a dynamic-length prefill ("'tmp6' was not declared in
    this scope"): there the prefill compiles without indirect-index bounds checks (the index is an arange below the
    size it is checked against; tests/torch_faults.py holds the reproduction)."""
    import torch._inductor.config

    version = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    if device.type != "cpu" or version >= (2, 13):
        return contextlib.nullcontext()
    return torch._inductor.config.patch(assert_indirect_indexing=False)


def _check(config, logits_processor, stopping_criteria, synced_gpus: bool, model_kwargs: dict) -> None:
    if synced_gpus:
        raise _refuse("synced_gpus (ZeRO-3, FSDP) runs every rank's loop in step on the host")
    if config.num_beams > 1:
        raise _refuse(f"beam search (num_beams={config.num_beams}) is not decoded on the device")
    if config.return_dict_in_generate and (config.output_scores or config.output_attentions
                                           or config.output_hidden_states):
        raise _refuse("return_dict_in_generate returns sequences and output_logits only")
    unknown = set(model_kwargs) - MODEL_KWARGS
    if unknown:
        raise _refuse(f"{sorted(unknown)} are not passed to the decode step (assistant models, multimodal inputs)")
    for processor in logits_processor:
        if type(processor) not in ON_DEVICE:
            raise _refuse(f"the logits processor {type(processor).__name__} reads the sequence on the host")
    for criteria in stopping_criteria:
        if type(criteria) not in HANDLED:
            raise _refuse(f"the stopping criteria {type(criteria).__name__} runs on the host")


def cache_length(config, needed: int) -> int:
    """The length of the cache fxquant.generate allocates for `needed` positions: a power of two, at least
    SHORTEST_CACHE. Each cache length is a graph of its own for the decode step, compiled anew (dynamo's recompile
    limit, 8, refuses the ninth), so prompt and max_new_tokens lengths share one per doubling instead of one each.
    The unfilled tail costs memory, and the prompt's attention (SDPA over the whole cache) reads it; the decode
    steps' attention kernel reads no block of it, which their mask hides. Where a sliding window holds the positions
    but not the power of two, the window's length: every layer then has the same length, the window layers as full
    ones."""
    length = max(SHORTEST_CACHE, 1 << (needed - 1).bit_length())
    window = getattr(config.get_text_config(), "sliding_window", None)
    return window if isinstance(window, int) and needed <= window < length else length


def _static_cache(model, model_kwargs, batch: int, needed: int) -> StaticCache:
    """The given StaticCache (or FP8StaticCache), else one of the model's own (`cache_length` long), kept for the
    next call with its tensors at the same addresses, so that the captured step is replayed rather than captured
    again."""
    given = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    if isinstance(given, StaticCache):
        if int(given.get_seq_length()) > 0:
            raise _refuse("the given cache already holds tokens, and continuing from it is not supported; "
                          "or call cache.reset() first")
        cache = given
    elif given is None or given.get_seq_length() == 0:  # transformers' default, an empty DynamicCache
        caches, length = kept(model).caches, cache_length(model.config, needed)
        if (batch, length) not in caches:
            caches.clear()  # one at a time: a cache is the model's largest activation
            caches[batch, length] = StaticCache(config=model.config, max_cache_len=length)
        cache = caches[batch, length]
        cache.reset()  # the last call's tokens
    else:
        raise _refuse(f"a {type(given).__name__} already holding tokens is not a static cache")
    for index, layer in enumerate(cache.layers):
        room = getattr(layer, "max_cache_len", 0)
        if type(layer) not in FULL_LAYER and type(layer) not in FULL_LAYER.values():
            raise _refuse(f"cache layer {index} is a {type(layer).__name__}, no static attention layer")
        if room < needed:
            what = "sliding window" if type(layer) in FULL_LAYER else "cache"
            raise ValueError(f"fxquant.generate: cache layer {index}'s {what} holds {room} tokens; the prompt and "
                             f"max_new_tokens need {needed}. Fix: a cache of max_cache_len >= {needed}, or "
                             f"model.generate, whose sliding layers roll on the host")
        if type(layer) in FULL_LAYER:
            _as_full(layer)
    return cache


def _as_full(layer) -> None:
    layer.__class__ = FULL_LAYER[type(layer)]
    if getattr(layer, "scales", None) is not None:  # FP8StaticCache's twin layer of scales
        _as_full(layer.scales)


def _runner(model, options, cache, shape: tuple[int, int], masked: bool, choice: Choice) -> Runner:
    """The model's runner for this cache and these settings: kept, with its captured graph, for the next call. The
    runner holds the cache and the generator, so that no other object can take their ids while it lives. shape:
    (batch, new tokens); the new tokens tell runners apart only where the logits are kept, one row per token."""
    batch, new_tokens = shape
    key = (id(cache), batch, masked, choice.key, repr(options), new_tokens if choice.keep_logits else None)
    runners = kept(model).runners
    if key not in runners:
        runners.clear()  # a runner holds its cache and its graph's memory: one at a time
        runners[key] = Runner(model, _forwards(model, options), cache, shape, masked, choice)
    return runners[key]


def _forwards(model, options):
    """The prefill's and the decode step's forwards: under options, the fxquant backend's, the prefill's with dynamic
    shapes (one graph for every prompt length) and the step's static (a graph to capture); else the model as it is
    for both, as generate() runs it."""
    if options is None:
        return model, model
    compiled = kept(model).forwards
    if repr(options) not in compiled:
        compiled[repr(options)] = tuple(torch.compile(model.forward, backend="fxquant", options=options,
                                                      dynamic=dynamic) for dynamic in (True, False))
    return compiled[repr(options)]
