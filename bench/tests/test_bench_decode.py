"""bench.decode's host breakdown: timing fxquant's wrapper alone leaves the compiled step as it was, and timing CUDA
graph replays counts each replay and restores replay()."""
import pytest
import torch
import transformers as T

from bench.common import llama_config
from bench.decode import Decoder, compiled_forward, graph_replays, launch_settings, recipe_options
from fxquant.compile.backend import QuantizedCallable

VOCAB = 512


def small_llama() -> T.LlamaForCausalLM:
    """Two layers of the benchmarks' Llama shapes at hidden 256, in fp32."""
    torch.manual_seed(0)
    return T.LlamaForCausalLM(llama_config(2, 256, VOCAB)).eval()


@pytest.mark.cpu_only
def test_timing_the_wrapper_alone_restores_the_compiled_step():
    """wrapper_us replaces the compiled graph by a no-op and the callable's __call__ by a recorder while it times;
    afterwards the step runs the real graph again and gives the logits it gave before."""
    call = QuantizedCallable.__call__
    model = small_llama()
    runner, forward, callables = compiled_forward(model, "fxquant:fp8_row", "default")
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, VOCAB, (1, 6), generator=generator)
    tokens = torch.randint(0, VOCAB, (1, 6), generator=generator)
    step = Decoder(runner, forward, "cpu", 16, callables=callables)
    with torch.no_grad():
        before = step.steps(prompt, tokens)[0]
        assert callables and step.wrapper_us(prompt, tokens, calls=5, repeats=2) > 0
        after = step.steps(prompt, tokens)[0]
    assert QuantizedCallable.__call__ is call
    torch.testing.assert_close(after, before, rtol=0, atol=0)


@pytest.mark.cpu_only
def test_graph_replay_timing_restores_replay_and_counts_only_replays():
    """Steps on the CPU launch no CUDA graph: each step's replay time is 0, one per step, and replay() is the
    original afterwards."""
    replay = torch.cuda.CUDAGraph.replay
    model = small_llama()
    runner, forward, callables = compiled_forward(model, "fxquant:fp8_row", "default")
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, VOCAB, (1, 6), generator=generator)
    tokens = torch.randint(0, VOCAB, (1, 3), generator=generator)
    replays = []
    with torch.no_grad():
        Decoder(runner, forward, "cpu", 16, callables=callables).steps(prompt, tokens, replays=replays)
    assert replays == [0.0, 0.0, 0.0]
    assert torch.cuda.CUDAGraph.replay is replay


@pytest.mark.gpu
def test_graph_replays_times_each_replay():
    """A captured graph replayed twice inside graph_replays gives two positive host times; replay() is restored."""
    replay = torch.cuda.CUDAGraph.replay
    x = torch.zeros(8, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x.add_(1)
    times = []
    with graph_replays(times):
        graph.replay()
        graph.replay()
    torch.cuda.synchronize()
    assert len(times) == 2 and all(t > 0 for t in times)
    assert torch.cuda.CUDAGraph.replay is replay
    assert x.tolist() == [2.0] * 8  # capturing runs nothing; each replay adds 1


def test_path_suffixes_become_backend_options():
    """fxquant:<recipe>+head=<recipe> adds the lm_head under the second recipe (the plain path keeps it in bf16, and
    tests/test_real_models.py checks that the option quantizes it); +without= leaves a pass out; +inductor= turns one of
    Inductor's options on (or off, after =0); +rows holds int4 codes in rows."""
    assert recipe_options("fxquant:fp8_row") == {"recipe": "fp8_row"}
    assert recipe_options("fxquant:fp8_row+head=int8_wo+fp8kv") == {
        "recipe": "fp8_row", "layer_recipes": {r"(^|\.)lm_head$": "int8_wo"}}
    assert recipe_options("fxquant:fp8_row+without=fuse_silu_mul+without=fuse_norm") == {
        "recipe": "fp8_row", "disable_passes": ["fuse_silu_mul", "fuse_norm"]}
    assert recipe_options("fxquant:fp8_row+inductor=combo_kernels") == {
        "recipe": "fp8_row", "inductor": {"combo_kernels": True}}
    assert recipe_options("fxquant:int4_wo+inductor=triton.enable_pdl=0+inductor=combo_kernels") == {
        "recipe": "int4_wo", "inductor": {"triton.enable_pdl": False, "combo_kernels": True}}
    assert recipe_options("fxquant:int4_wo+rows") == {"recipe": "int4_wo", "int4_code_tiles": False}
    assert recipe_options("fxquant:int4_fp8+tiles") == {"recipe": "int4_fp8", "int4_code_tiles": True}
    assert recipe_options("fxquant:mxfp4_wo+fp4inregisters") == {"recipe": "mxfp4_wo", "fp4_lanes": False}
    assert recipe_options("fxquant:int4_fp8+w4a8kernel") == {"recipe": "int4_fp8", "int4_fp8_lanes": False}
    for setting in ("+nopdl", "+reducekernel", "+prefetch", "+mma8"):  # launch settings, applied by work()
        assert recipe_options("fxquant:fp8_row" + setting) == {"recipe": "fp8_row"}
    with pytest.raises(ValueError, match=r"'\+heads' is none of"):
        recipe_options("fxquant:fp8_row+heads=int8_wo")


def test_an_inplace_path_compiles_a_quantize_d_copy_and_leaves_the_model_as_it_was():
    """+inplace times a loaded checkpoint's path: the layers quantize_'s QuantizedLinear, compiled by the backend."""
    model = small_llama()
    weight = model.model.layers[0].mlp.down_proj.weight
    runner, forward, callables = compiled_forward(model, "fxquant:int4_wo+inplace", "default")
    assert type(runner.model.layers[0].mlp.down_proj).__name__ == "QuantizedLinear" and runner is not model
    assert model.model.layers[0].mlp.down_proj.weight is weight
    assert recipe_options("fxquant:int4_wo+inplace") == {"recipe": "int4_wo"}


def test_launch_settings_turn_off_what_the_path_names_and_only_inside_the_block():
    from fxquant.kernels import dependent_launch, gemm_fp8, gemm_int4_mma, gemm_weight_only, splitk

    with launch_settings("fxquant:fp8_row+reducekernel"):  # each kernel's own prefetch default: None
        assert dependent_launch._enabled[0] and not splitk._in_gemm[0] and dependent_launch._prefetch[0] is None
    with launch_settings("fxquant:int4_wo+prefetch"):
        assert dependent_launch._prefetch[0] is True and splitk._in_gemm[0] and gemm_int4_mma.serves_rows() == 1
    with launch_settings("fxquant:fp8_row+noprefetch"):  # not read as +prefetch
        assert dependent_launch._prefetch[0] is False
    with launch_settings("fxquant:int4_wo+mma8"):
        assert gemm_int4_mma.serves_rows() == 8
    with launch_settings("fxquant:fp8_row", profiled=True):  # a profile launches without PDL
        assert not dependent_launch._enabled[0] and splitk._in_gemm[0]
    plan_16 = lambda: gemm_fp8._launch_plan(16, 4096, 4096, False, False, ())[3]["BLOCK_N"]
    with launch_settings("fxquant:fp8_row+tiles64"):  # 16 rows in the tiles of 8, as before decision 0035
        assert plan_16() == 64
    assert dependent_launch._enabled[0] and splitk._in_gemm[0] and dependent_launch._prefetch[0] is None
    assert gemm_int4_mma.serves_rows() == 1 and plan_16() == 32
    shipped = gemm_weight_only.CHUNK_ELEMENTS
    with launch_settings("fxquant:int4_wo+chunk=23+nopdl"):  # the weight-only prefill's chunks: 2**23 elements
        assert gemm_weight_only.CHUNK_ELEMENTS == 2**23 and not dependent_launch._enabled[0]
    assert shipped == gemm_weight_only.CHUNK_ELEMENTS
    assert recipe_options("fxquant:int4_wo+chunk=23") == {"recipe": "int4_wo"}


def test_too_few_steps_to_time_are_refused_by_name(monkeypatch, capsys):
    """The first CHECK_STEPS steps compile and are checked, untimed: --steps at most that many would time nothing
    (it failed each row with `no median for empty data`), so the command line refuses it before any work."""
    from bench import decode

    monkeypatch.setattr("sys.argv", ["bench.decode", "--device", "cpu", "--steps", str(decode.CHECK_STEPS)])
    with pytest.raises(SystemExit):
        decode.main()
    assert f"--steps {decode.CHECK_STEPS}: the first {decode.CHECK_STEPS} steps" in capsys.readouterr().err
