"""GraphDecoder: a transformers model's decode step over TQCache replayed as one CUDA graph matches the
same steps run eagerly (tokens and logits); the argument checks run anywhere."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
if int(transformers.__version__.split(".")[0]) < 5:
    pytest.skip("needs transformers >= 5", allow_module_level=True)

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from flash_attn_tq import ops  # noqa: E402
from flash_attn_tq.integrations.graphs import GraphDecoder  # noqa: E402
from flash_attn_tq.integrations.transformers import ATTN_IMPLEMENTATION, TQCache  # noqa: E402

GPU = torch.cuda.is_available() and ops.extension_available()


def llama(device="cpu", dtype=torch.float32, layers=3, head_dim=64):
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=4 * head_dim,
        intermediate_size=512,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=4096,
    )
    model = LlamaForCausalLM(cfg).eval().to(device=device, dtype=dtype)
    with torch.no_grad():  # larger logits: greedy choices are not near-ties
        model.lm_head.weight.mul_(8)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return model


def test_argument_checks():
    model = llama()
    with pytest.raises(TypeError, match="TQCache"):
        GraphDecoder(model, object())
    with pytest.raises(ValueError, match="max_cache_len"):
        GraphDecoder(model, TQCache(model.config))
    with pytest.raises(ValueError, match="protected_layers"):
        GraphDecoder(model, TQCache(model.config, max_cache_len=64, protected_layers=(1,)))
    with pytest.raises(ValueError, match="CUDA"):
        GraphDecoder(model, TQCache(model.config, max_cache_len=64))
    model.set_attn_implementation("sdpa")
    with pytest.raises(ValueError, match="attn_implementation"):
        GraphDecoder(model, TQCache(model.config, max_cache_len=64))


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU and the flash_attn_tq_cuda extension")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_graph_steps_match_eager_steps(dtype, head_dim):
    """The default cache (RoPE center, 16 sinks, 112-token window) plus a K8V8 head group in one layer;
    a 300-token prompt, then 150 steps (past the window), graph against eager."""
    model = llama("cuda", dtype, head_dim=head_dim)
    kw = dict(max_cache_len=512, head_options={(1, 0): {"k_bits": 8, "v_bits": 8}})
    prompt = torch.randint(0, 128, (2, 300), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    dec = GraphDecoder(model, TQCache(model.config, **kw))
    ref_cache = TQCache(model.config, **kw)
    with torch.no_grad():
        ref = model(input_ids=prompt, past_key_values=ref_cache, use_cache=True, logits_to_keep=1).logits[:, -1]
    got = dec.prefill(prompt)
    torch.testing.assert_close(got, ref)
    nxt = ref.argmax(-1, keepdim=True)
    for t in range(150):
        got = dec.step(nxt).clone()
        pos = torch.full_like(nxt, 300 + t)
        with torch.no_grad():
            ref = model(
                input_ids=nxt, position_ids=pos, past_key_values=ref_cache, use_cache=True, logits_to_keep=1
            ).logits[:, -1]
        assert (got - ref).abs().max().item() <= 1e-2 * ref.abs().max().item(), t
        nxt = ref.argmax(-1, keepdim=True)
    assert dec.graph is not None and dec.length == ref_cache.get_seq_length() == 450
    for mine, theirs in zip(dec.cache.quantized_caches(), ref_cache.quantized_caches()):
        for a, b in zip(
            mine if isinstance(mine, tuple) else (mine,), theirs if isinstance(theirs, tuple) else (theirs,)
        ):
            assert torch.equal(a.seqlens, b.seqlens) and torch.equal(a.k_codes, b.k_codes)
    dec.check()


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU and the flash_attn_tq_cuda extension")
def test_generate_and_capacity():
    model = llama("cuda", torch.float16)
    prompt = torch.randint(0, 128, (1, 40), device="cuda")
    dec = GraphDecoder(model, TQCache(model.config, max_cache_len=64))
    out = dec.generate(prompt, max_new_tokens=25)
    assert out.shape == (1, 65) and torch.equal(out[:, :40], prompt)
    with pytest.raises(ValueError, match="cache full"):
        dec.step(out[:, -1:])
    with pytest.raises(ValueError, match="exceed max_cache_len"):
        GraphDecoder(model, TQCache(model.config, max_cache_len=64)).generate(prompt, max_new_tokens=30)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU and the flash_attn_tq_cuda extension")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_generate_compiles_the_decode_steps(dtype):
    """transformers' generate over a TQCache with max_cache_len compiles its decode steps (inductor,
    CUDA graphs): one graph, no recompilation, no CUDA-graph skip; tokens and logits as eager; the
    default options plus a K8V8 head group (its layer's two head groups in one decode launch in the
    compiled steps too), 150 steps (past the window)."""
    from torch._dynamo.utils import counters

    model = llama("cuda", dtype)
    prompt = torch.randint(0, 128, (2, 300), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    kw = dict(max_cache_len=512, head_options={(1, 0): {"k_bits": 8, "v_bits": 8}})
    runs = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        counters.clear()
        cache = TQCache(model.config, **kw)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            runs[compiled] = model.generate(
                prompt, past_key_values=cache, max_new_tokens=150, do_sample=False, disable_compile=not compiled,
                output_logits=True, return_dict_in_generate=True,
            )  # fmt: skip
        cache.pack_errors.check()
        assert cache.get_seq_length() == 300 + 149
        assert any("decode_pair_kernel" in e.name for e in prof.events()), compiled
    assert counters["stats"]["unique_graphs"] == 1 and not counters["recompiles"]
    assert not counters["inductor"]["cudagraph_skips"]
    # the model's own ops compile to other kernels (rounding differs): the logits agree step by step,
    # and the greedy tokens until a near-tie, if any, where the two runs may part
    differ = (runs[True].sequences != runs[False].sequences).any(0).nonzero()
    first = differ[0].item() - 300 if differ.numel() else 150
    tol = 1e-2 if dtype == torch.float16 else 3e-2
    for t, (got, ref) in enumerate(zip(runs[True].logits[: first + 1], runs[False].logits[: first + 1])):
        bound = tol * ref.abs().max().item()
        assert (got - ref).abs().max().item() <= bound, t
        if t == first:
            top2 = ref.float().topk(2, dim=-1).values
            assert (top2[:, 0] - top2[:, 1]).min().item() <= 2 * bound, "parted without a near-tie"


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU and the flash_attn_tq_cuda extension")
def test_compiled_steps_past_the_capacity_raise_at_the_check():
    model = llama("cuda", torch.float16)
    prompt = torch.randint(0, 128, (1, 40), device="cuda")
    cache = TQCache(model.config, max_cache_len=48)
    model.generate(prompt, past_key_values=cache, max_new_tokens=20, do_sample=False)
    with pytest.raises(ValueError, match="overflow"):
        cache.pack_errors.check()


class ScriptedDecoder(GraphDecoder):
    """GraphDecoder's generate() loop over scripted logits (no model, no graph): step t returns row t."""

    def __init__(self, logits):
        self.device, self.capacity, self.script, self.calls = torch.device("cpu"), 1000, logits, []

    def prefill(self, input_ids):
        self.calls.append(None)
        return self.script[0]

    def step(self, ids):
        self.calls.append(ids.clone())
        return self.script[len(self.calls) - 1]

    def check(self):
        pass


def test_generate_greedy_eos_and_sampling():
    from flash_attn_tq.integrations.graphs import sampling_probs

    V, eos = 6, 5
    one_hot = lambda *tokens: torch.nn.functional.one_hot(torch.tensor(tokens), V).float() * 10  # noqa: E731
    script = [one_hot(1, 2), one_hot(eos, 3), one_hot(4, eos), one_hot(2, 2), one_hot(0, 0)]
    prompt = torch.zeros(2, 3, dtype=torch.long)
    out = ScriptedDecoder(script).generate(prompt, max_new_tokens=5)
    assert out[:, 3:].tolist() == [[1, eos, 4, 2, 0], [2, 3, eos, 2, 0]]
    dec = ScriptedDecoder(script)
    out = dec.generate(prompt, max_new_tokens=5, eos_token_id=eos)
    assert out[:, 3:].tolist() == [[1, eos, eos], [2, 3, eos]] and len(dec.calls) == 3  # both done: stop
    # sampling: top_k=1 is greedy; the probabilities follow transformers' warpers
    g = torch.Generator().manual_seed(0)
    out = ScriptedDecoder(script).generate(prompt, max_new_tokens=5, do_sample=True, top_k=1, generator=g)
    assert out[:, 3:].tolist() == [[1, eos, 4, 2, 0], [2, 3, eos, 2, 0]]
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    p = sampling_probs(logits, temperature=0.5)
    torch.testing.assert_close(p, (logits / 0.5).softmax(-1))
    p = sampling_probs(logits, top_p=0.7)  # softmax: 0.64, 0.24, ...: the first two reach 0.7
    assert (p[0, :2] > 0).all() and (p[0, 2:] == 0).all()
    torch.testing.assert_close(p[0, :2], logits[0, :2].softmax(-1))
    assert (sampling_probs(logits, top_k=3)[0, 3] == 0) and sampling_probs(logits, top_p=0.1)[0, 0] == 1
    with pytest.raises(ValueError, match="temperature"):
        ScriptedDecoder(script).generate(prompt, 2, do_sample=True, temperature=0.0)
