"""A float32 decode step's C++ ops (citer.decoding.cpu_step, cpu_step_f32.cpp): the norm and the MLP's gate equal
torch's up to float32 rounding, masked widths included; decode steps through them (ragged rows, a held row, named
slots) give HF's logits at every position; each row's outputs are the same alone as beside others; and only float32
decode steps of a model whose linears take the AVX2 kernel take them."""

from __future__ import annotations

import functools
import shutil

import pytest
import torch
import torch.nn.functional as F

from citer.decoding import cpu_step
from citer.decoding.context import prepare
from citer.decoding.kv_pool import KVPool
from citer.decoding.runner import ModelRunner
from citer.kernels import cpu_linear


def _buildable() -> bool:
    from torch.utils.cpp_extension import is_ninja_available

    cpu = cpu_linear.host_cpu()
    return cpu.has("avx2") and cpu.has("fma") and bool(shutil.which("c++")) and is_ninja_available()


pytestmark = [
    pytest.mark.skipif(not _buildable(), reason="no AVX2 and FMA, no C++ compiler or no ninja here"),
    pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN"),
]
V = 97


@pytest.fixture
def fp32_kernels(monkeypatch):
    """The float32 path on whatever this CPU's vendor (its gate is cpu_linear's, tested there)."""
    monkeypatch.setattr(cpu_linear, "_state", {**cpu_linear._state, "fp32": True, "f32_kernel": True})
    assert cpu_linear.f32_available(), "the AVX2 kernels did not build here"


def build(family: str, hidden: int = 256, layers: int = 2, seed: int = 0):
    """A model whose fused q/k/v weight reaches FP32_PACKED_MIN at hidden 256 (4 heads of 64, 2 KV heads)."""
    import transformers as tf

    common = dict(vocab_size=V, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  tie_word_embeddings=False, eos_token_id=1, pad_token_id=0)  # fmt: skip
    cls, cfg = {
        "llama": (tf.LlamaForCausalLM, tf.LlamaConfig),
        "qwen2": (tf.Qwen2ForCausalLM, tf.Qwen2Config),  # q/k/v biases
        "qwen3": (tf.Qwen3ForCausalLM, tf.Qwen3Config),  # per-head norms
    }[family]
    torch.manual_seed(seed)
    model = cls(cfg(**common))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
            elif p.dim() == 1:  # biases: nonzero, so a bias dropped shows
                p.normal_(0, 0.5)
    return model.eval()


@pytest.mark.usefixtures("fp32_kernels")
@pytest.mark.parametrize("width", [576, 577, 5])
def test_the_norm_and_the_gate_are_torchs_up_to_rounding(width):
    torch.manual_seed(1)
    x, w = torch.randn(3, 1, width), torch.rand(width) + 0.5
    torch.testing.assert_close(torch.ops.citer.rms_norm_f32(x, w, 1e-5), F.rms_norm(x, (width,), w, 1e-5))
    gu = torch.randn(3, 1, 2 * width) * 4
    g, u = gu.chunk(2, dim=-1)
    torch.testing.assert_close(torch.ops.citer.silu_mul_f32(gu), F.silu(g) * u)


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]  # (T, V)


@pytest.mark.usefixtures("fp32_kernels")
@pytest.mark.parametrize(("family", "hidden"), [("llama", 256), ("qwen2", 256), ("llama", 512)])
def test_decode_steps_through_the_step_ops_equal_hf(family, hidden, monkeypatch):
    """Rows of different lengths in named slots, one held every other step: every step runs the step ops, and each
    returned logit row equals HF's full forward at that position. At hidden 256 the output projection is below the
    kernel's weights (cpu_linear chooses each product); at 512 every product is the kernel's, called directly."""
    model = build(family, hidden=hidden)
    calls = []
    layer = cpu_step.decode_layer
    monkeypatch.setattr(cpu_step, "decode_layer", lambda *a, **k: calls.append(1) or layer(*a, **k))
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18]]
    seqs = [list(p) for p in prompts]
    slots = [2, 0, 1]  # rows fed out of slot order: attended in place, a run at a time
    pool = KVPool(model, 3, 32)
    runner = ModelRunner(model)
    got: dict[int, list[torch.Tensor]] = {r: [] for r in range(3)}
    with torch.inference_mode():
        runner.feed(pool, [seqs[slots.index(s)] for s in range(3)])
        for step in range(5):
            chunks = [[30 + 3 * step + r] for r in range(3)]
            if step % 2:
                chunks[1] = []
            calls.clear()
            logits, _ = runner.feed(pool, chunks, slots=slots)
            assert len(calls) == model.config.num_hidden_layers
            for r, c in enumerate(chunks):
                if c:
                    seqs[r] += c
                    got[r].append(logits[r])
    for r, s in enumerate(seqs):
        ref = hf_logits(model, s)[len(prompts[r]) :]
        torch.testing.assert_close(torch.stack(got[r]), ref, atol=2e-4, rtol=2e-4)


@pytest.mark.usefixtures("fp32_kernels")
@pytest.mark.parametrize("prompts", [[[5, 6, 7, 8, 9]], [[5, 6, 7], [8, 9, 10]]])
def test_rows_of_one_length_in_the_slot_prefix_equal_hf(prompts, monkeypatch):
    """Batch 1 and rows of one length: steps without a mask over the slot prefix (the pool's views, no runs)."""
    model = build("llama")
    masks = []
    layer = cpu_step.decode_layer
    monkeypatch.setattr(cpu_step, "decode_layer", lambda *a, **k: masks.append(a[3]) or layer(*a, **k))
    seqs = [list(p) for p in prompts]
    pool = KVPool(model, len(seqs), 32)
    runner = ModelRunner(model)
    got: list[list[torch.Tensor]] = [[] for _ in seqs]
    with torch.inference_mode():
        runner.feed(pool, seqs)
        for step in range(4):
            logits, _ = runner.feed(pool, [[40 + step + r] for r in range(len(seqs))])
            for r in range(len(seqs)):
                seqs[r].append(40 + step + r)
                got[r].append(logits[r])
    assert len(masks) == 4 * model.config.num_hidden_layers and all(m is None for m in masks)
    for r, s in enumerate(seqs):
        ref = hf_logits(model, s)[len(prompts[r]) :]
        torch.testing.assert_close(torch.stack(got[r]), ref, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_a_rows_attention_is_the_same_alone_and_beside_others_and_its_key_is_ropes(dtype, request):
    from citer.decoding.layers import rotate

    if dtype is torch.float32:
        request.getfixturevalue("fp32_kernels")
    elif not cpu_linear.available():
        pytest.skip("no AVX512-BF16 or no compiler here")
    attention = cpu_step.step_ops(dtype).attention
    torch.manual_seed(3)
    nh, kv, d, cap = 4, 2, 64, 40
    kb, vb = torch.randn(5, kv, cap + 1, d).to(dtype), torch.randn(5, kv, cap + 1, d).to(dtype)
    qkv = torch.randn(3, (nh + 2 * kv) * d).to(dtype)
    cos, sin = torch.randn(3, d).to(dtype), torch.randn(3, d).to(dtype)
    rows, cols = torch.tensor([4, 0, 2]), torch.tensor([17, 30, 9])
    mask = torch.arange(31)[None] <= cols[:, None]  # (3, K)

    def run(i: slice, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attention(qkv[i], cos[i], sin[i], k, v, rows[i], cols[i], mask[i], 31, nh, kv, 0.125)

    kt, vt = kb.clone(), vb.clone()
    together = run(slice(None), kt, vt)  # (3, nh D)
    for i in range(3):
        k1, v1 = kb.clone(), vb.clone()
        assert torch.equal(run(slice(i, i + 1), k1, v1)[0], together[i])
        assert torch.equal(k1[rows[i], :, cols[i]], kt[rows[i], :, cols[i]])
    # The written value is the projection's, the key the lean forward's rotation (bf16: bit for bit, each op rounded
    # where torch's rounds), and the output torch's attention in float32 over the same keys and values
    q_new = rotate(qkv[:, : nh * d].view(3, nh, d), cos[:, None], sin[:, None])
    k_new = rotate(qkv[:, nh * d : (nh + kv) * d].view(3, kv, d), cos[:, None], sin[:, None])
    v_new = qkv[:, (nh + kv) * d :].view(3, kv, d)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype is torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    for i in range(3):
        assert torch.equal(vt[rows[i], :, cols[i]], v_new[i])
        if dtype is torch.bfloat16:
            assert torch.equal(kt[rows[i], :, cols[i]], k_new[i])
        torch.testing.assert_close(kt[rows[i], :, cols[i]], k_new[i])
        k, v = kt[rows[i], :, :31].float(), vt[rows[i], :, :31].float()
        ref = F.scaled_dot_product_attention(
            q_new[i].float()[None, :, None], k[None], v[None], attn_mask=mask[i][None, None, None], scale=0.125,
            enable_gqa=True,
        )[0, :, 0].reshape(-1)  # fmt: skip
        torch.testing.assert_close(together[i].float(), ref, **tol)


@pytest.mark.usefixtures("fp32_kernels")
def test_only_float32_decode_steps_of_kernel_sized_models_take_the_step_ops(monkeypatch):
    def layer(model, chunks, packed=False):
        runner = ModelRunner(model)
        pool = KVPool(model, len(chunks), 16)
        with torch.inference_mode():
            runner.feed(pool, [[3, 4, 5]] * len(chunks))
            inp = prepare(pool, chunks, list(range(len(chunks))), packed, lean=True, in_place=True)
            return cpu_step.step_for(runner.lean, inp.ids, inp.mask, pool, inp.call)[0]

    big = build("llama", layers=1)  # its output projection is below the kernel's weights: cpu_linear chooses
    chosen = layer(big, [[7], [8]])
    assert chosen.func is cpu_step.decode_layer and chosen.keywords == {
        "ops": cpu_step.step_ops(torch.float32)
    }
    bigger = build("llama", hidden=512, layers=1)  # every product on the kernel: called directly
    direct = layer(bigger, [[7], [8]])
    f32 = cpu_step.step_ops(torch.float32)
    assert direct.func is cpu_step.decode_layer and direct.keywords == {
        "ops": f32,
        "linear": torch.ops.citer.linear_f32,
    }
    many = [[7]] * (cpu_linear.F32_MAX_ROWS + 1)  # rows the packed weight takes
    assert layer(bigger, many).keywords == {"ops": f32}
    assert layer(big, [[7, 8], [9]]) is None  # a catch-up: more than one token a row
    assert layer(big, [[7, 8], [9]], packed=True) is None
    assert layer(build("qwen3", layers=1), [[7]]) is None  # per-head norms
    small = build("llama", hidden=64, layers=1)  # below the kernel's weights: torch's ops
    assert layer(small, [[7]]) is None
    state = cpu_linear._state
    monkeypatch.setattr(cpu_linear, "_state", {**state, "step_ops": False})  # switched off (the benches)
    assert layer(big, [[7]]) is None
    monkeypatch.setattr(cpu_linear, "_state", {**state, "fp32": False})  # off the AMD gate
    assert layer(big, [[7]]) is None
    monkeypatch.setattr(cpu_linear, "_state", state)
    runner = ModelRunner(big)
    pool = KVPool(big, 1, 16)
    with torch.no_grad():
        runner.feed(pool, [[3, 4, 5]])
        inp = prepare(pool, [[7]], [0], False, lean=True, in_place=True)
    with torch.enable_grad():  # no backward through the ops
        assert cpu_step.step_for(runner.lean, inp.ids, inp.mask, pool, inp.call) == (None, None)


# -- bf16 (cpu_step_bf16.cpp, built into the AVX512-BF16 kernel's extension) -----------------------------------------
needs_bf16_kernel = pytest.mark.skipif(
    not cpu_linear.available(), reason="no AVX512-BF16 or no compiler here"
)


@needs_bf16_kernel
@pytest.mark.parametrize("width", [576, 577, 5])
def test_the_bf16_norm_and_gate_round_where_torchs_ops_do(width):
    from citer.decoding.layers import rms_norm

    torch.manual_seed(1)
    x, w = torch.randn(3, 1, width).bfloat16(), (torch.rand(width) + 0.5).bfloat16()
    cpu_linear.use_step_ops(False)  # the lean forward's torch ops
    try:
        ref = rms_norm(x, w, 1e-5)
    finally:
        cpu_linear.use_step_ops(True)
    got = torch.ops.citer.rms_norm_bf16(x, w, 1e-5)
    assert got.dtype is torch.bfloat16
    # the statistics sum in another order: a value may round to the neighbouring bf16, no further
    assert (got.float() - ref.float()).abs().le(ref.float().abs() * 2**-7).all()
    assert (got == ref).float().mean() > 0.95
    gu = (torch.randn(3, 1, 2 * width) * 4).bfloat16()
    g, u = gu.chunk(2, dim=-1)
    got, ref = torch.ops.citer.silu_mul_bf16(gu), F.silu(g) * u
    assert (got.float() - ref.float()).abs().le(ref.float().abs() * 2**-6 + 1e-30).all()
    assert (got == ref).float().mean() > 0.95


@needs_bf16_kernel
def test_prompt_sized_bf16_norms_and_gates_take_the_ops_split_among_threads_row_by_row():
    """The lean forward's norm and gate (citer.decoding.layers) take the C++ ops in an eager bf16 call: a call of
    hundreds of rows, split among the threads, gives every row the bits of that row alone; under autograd, in
    float32 or with the step ops off they stay torch's ops."""
    from citer.decoding.layers import rms_norm, silu_mul

    torch.manual_seed(2)
    x, w = torch.randn(600, 2048).bfloat16(), (torch.rand(2048) + 0.5).bfloat16()
    gu = (torch.randn(300, 4096) * 3).bfloat16()
    with torch.inference_mode():
        assert cpu_linear.row_ops(x, w) and cpu_linear.row_ops(gu)
        assert not cpu_linear.row_ops(x.float()) and not cpu_linear.row_ops(x, w.float())
        norms, gates = rms_norm(x, w, 1e-6), silu_mul(gu)
        assert torch.equal(norms, torch.ops.citer.rms_norm_bf16(x, w, 1e-6))
        assert torch.equal(gates, torch.ops.citer.silu_mul_bf16(gu))
        for r in (0, 299, 599):
            assert torch.equal(norms[r], torch.ops.citer.rms_norm_bf16(x[r : r + 1], w, 1e-6)[0])
        for r in (0, 150, 299):
            assert torch.equal(gates[r], torch.ops.citer.silu_mul_bf16(gu[r : r + 1])[0])
    g, u = gu.chunk(2, dim=-1)
    torch_gate, torch_norm = F.silu(g) * u, w * F.rms_norm(x.float(), (2048,), None, 1e-6).to(torch.bfloat16)
    torch.testing.assert_close(norms, torch_norm, atol=0, rtol=2**-7)  # the sum of squares in another order
    assert not cpu_linear.row_ops(gu.requires_grad_())
    assert torch.equal(silu_mul(gu), torch_gate)
    assert torch.equal(rms_norm(x, w.requires_grad_(), 1e-6), torch_norm)
    cpu_linear.use_step_ops(False)
    try:
        with torch.inference_mode():
            assert torch.equal(rms_norm(x, w, 1e-6), torch_norm)
    finally:
        cpu_linear.use_step_ops(True)


@needs_bf16_kernel
@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: q/k/v biases through the kernels
@pytest.mark.parametrize("n_rows", [3, 6])
def test_bf16_decode_steps_through_the_step_ops_follow_torchs_ops(n_rows, family, monkeypatch):
    """Rows in named slots, one held every other step, in bf16: every step runs the step ops, and the logits stay
    within bf16's rounding of the same steps through torch's ops; where one kernel takes every product (one row: the
    vdpbf16ps blocks; 2 to 32 on an AMX CPU: the tiles; without AMX, 3 rows the blocks and 6 beyond them) the step's
    layers run in one C++ call, bit for bit the layers called one at a time."""
    model = build(family).bfloat16()
    calls = []
    layer, stack = cpu_step.decode_layer, cpu_step.decode_stack
    monkeypatch.setattr(cpu_step, "decode_layer", lambda *a, **k: calls.append("layer") or layer(*a, **k))
    monkeypatch.setattr(cpu_step, "decode_stack", lambda *a, **k: calls.append("stack") or stack(*a, **k))
    step_for = cpu_step.step_for
    prompts = [[5 + r, 6, 7 + r, 8][: 2 + r % 3] for r in range(n_rows)]
    slots = list(reversed(range(n_rows)))  # out of slot order: attended in place, a run at a time
    one_kernel = cpu_linear.amx() or n_rows <= cpu_linear.MAX_ROWS

    def decode(mode: str) -> list[torch.Tensor]:
        cpu_linear.use_step_ops(mode != "torch ops")
        monkeypatch.setattr(cpu_step, "step_for", functools.partial(step_for, stack=mode == "stack"))
        want = {
            "stack": ["stack"] if one_kernel else ["layer"] * model.config.num_hidden_layers,
            "layers": ["layer"] * model.config.num_hidden_layers,
            "torch ops": [],
        }[mode]
        try:
            pool, runner = KVPool(model, n_rows, 32), ModelRunner(model)
            out = []
            with torch.inference_mode():
                runner.feed(pool, [prompts[slots.index(s)] for s in range(n_rows)])
                for step in range(5):
                    chunks = [[30 + 3 * step + r] for r in range(n_rows)]
                    if step % 2:
                        chunks[1] = []
                    calls.clear()
                    logits, _ = runner.feed(pool, chunks, slots=slots)
                    assert calls == want
                    out.append(logits.float())
            return out
        finally:
            cpu_linear.use_step_ops(True)
            monkeypatch.setattr(cpu_step, "step_for", step_for)

    got, layers, ref = decode("stack"), decode("layers"), decode("torch ops")
    # logits up to ~1, bf16's step there 2^-7; a RoPE sign flipped put them 0.067 off
    for a, one_by_one, b in zip(got, layers, ref, strict=True):
        assert torch.equal(a, one_by_one)
        torch.testing.assert_close(a, b, atol=0.025, rtol=0.01)

    def chosen(rows: int):
        with torch.inference_mode():
            pool, runner = KVPool(model, rows, 32), ModelRunner(model)
            runner.feed(pool, [[5, 6]] * rows)
            inp = prepare(pool, [[7]] * rows, list(range(rows)), False, lean=True, in_place=True)
            layer, stack = step_for(runner.lean, inp.ids, inp.mask, pool, inp.call, stack=False)
            assert stack is None
            return layer.keywords

    bf16, ops = cpu_step.step_ops(torch.bfloat16), torch.ops.citer
    assert chosen(1) == {"ops": bf16, "linear": ops.linear_bf16}
    if cpu_linear.amx():  # 2 to 32 rows on the AMX tiles
        assert chosen(n_rows) == {"ops": bf16, "linear": ops.linear_bf16_amx}
    cpu_linear.use_amx(False)
    try:  # the vdpbf16ps blocks up to MAX_ROWS, then cpu_linear chooses (the packed weight)
        want = {"ops": bf16, "linear": ops.linear_bf16} if n_rows <= cpu_linear.MAX_ROWS else {"ops": bf16}
        assert chosen(n_rows) == want
    finally:
        cpu_linear.use_amx(True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_names_the_operand_at_fault(dtype, request):
    """Both dtypes' attention ops check their operands alike (cpu_step_args.h): a bad call fails naming the op and
    the operand, before reading anything out of bounds."""
    if dtype is torch.float32:
        request.getfixturevalue("fp32_kernels")
        op, name = torch.ops.citer.decode_attention_f32, "decode_attention_f32"
    else:
        if not cpu_linear.available():
            pytest.skip("no AVX512-BF16 or no compiler here")
        op, name = torch.ops.citer.decode_attention_bf16, "decode_attention_bf16"
    b, nh, kv, D, R, C = 2, 4, 2, 64, 3, 8
    good = dict(
        qkv=torch.randn(b, (nh + 2 * kv) * D).to(dtype),
        cos=torch.ones(b, D, dtype=dtype),
        sin=torch.zeros(b, D, dtype=dtype),
        kbuf=torch.zeros(R, kv, C, D, dtype=dtype),
        vbuf=torch.zeros(R, kv, C, D, dtype=dtype),
        rows=torch.tensor([0, 2]),
        cols=torch.tensor([1, 3]),
        mask=torch.ones(b, 4, dtype=torch.bool),
        kv_len=4,
    )

    def call(**bad):
        a = good | bad
        return op(a["qkv"], a["cos"], a["sin"], a["kbuf"], a["vbuf"], a["rows"], a["cols"], a["mask"], a["kv_len"],
                  nh, kv, 0.125)  # fmt: skip

    assert call().shape == (b, nh * D)
    for bad, says in [
        (dict(rows=torch.tensor([0, R])), "row 1's slot or column"),
        (dict(cols=torch.tensor([C, 0])), "row 0's slot or column"),
        (dict(kv_len=C + 1), "kv_len"),
        (dict(qkv=good["qkv"][:, 1:]), "qkv must be"),
        (dict(mask=torch.ones(b, 5, dtype=torch.bool)), "mask must be"),
        (dict(cos=good["cos"][:1]), "cos/sin must be"),
        (dict(rows=torch.tensor([0, 1], dtype=torch.int32)), "rows and cols must be"),
        (dict(kbuf=torch.zeros(R, kv, D, C, dtype=dtype).transpose(2, 3)), "contiguous"),
        (dict(qkv=good["qkv"].double()), "must be"),
    ]:
        with pytest.raises(RuntimeError, match=f"{name}: .*{says}"):
            call(**bad)


@needs_bf16_kernel
@pytest.mark.parametrize("family", ["llama", "qwen3"])  # qwen3: per-head norms, its rotation on a copy
def test_bf16_prompts_through_the_row_ops_rotate_bit_for_bit_and_follow_torchs_ops(family):
    """A bf16 prompt call (many tokens a row) through the lean forward: RoPE's rotation by the extension's pass is
    torch's three ops bit for bit, and the logits with the norms and gates on the C++ ops stay within bf16's rounding
    of torch's ops."""
    from citer.decoding.layers import rotate

    torch.manual_seed(3)
    qkv = torch.randn(2, 37, 4 + 2 * 2, 64).bfloat16()
    cos, sin = torch.randn(2, 37, 1, 64).bfloat16(), torch.randn(2, 37, 1, 64).bfloat16()
    qk = qkv[:, :, :6]  # the queries' and keys' heads: a view, rows strided past the values
    with torch.inference_mode(), torch.profiler.profile() as prof:
        got = rotate(qk, cos, sin)
    assert "citer::rope_bf16" in {e.name for e in prof.events()}  # the op served
    assert got.is_contiguous()
    assert torch.equal(got, qk * cos + qk.roll(32, dims=-1) * sin)
    model = build(family).bfloat16()
    # beyond a decode step of their tokens (more key reads than TOKEN_STEP_KEYS): the lean forward's own layers
    prompts = [[5 + r] + [6 + i % 50 for i in range(80 + r)] for r in range(3)]
    assert sum(len(p) * (len(p) + 1) // 2 for p in prompts) > cpu_step.TOKEN_STEP_KEYS

    def last_logits() -> torch.Tensor:
        with torch.inference_mode():
            logits, _ = ModelRunner(model).feed(KVPool(model, 3, 96), prompts)
        return logits.float()

    got = last_logits()
    cpu_linear.use_step_ops(False)
    try:
        ref = last_logits()
    finally:
        cpu_linear.use_step_ops(True)
    torch.testing.assert_close(got, ref, atol=0.025, rtol=0.01)


@needs_bf16_kernel
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_bf16_catch_ups_run_as_a_decode_step_of_their_tokens_and_give_each_rows_stepped_logits(
    family, monkeypatch
):
    """Short bf16 chunks (a catch-up: named slots out of order, one row held) run as one decode step of their tokens,
    through the step ops: every fed position's logits are those of the same rows fed a token a step, bit for bit
    where the AMX tiles take both (a row's products do not depend on the call's other rows), and within bf16's
    rounding of the library kernel's attention over the same call. Calls past TOKEN_STEP_KEYS, float32, per-head
    norms and autograd keep the lean forward's layers."""
    model = build(family).bfloat16()
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
    slots = [2, 0, 3, 1]
    chunks = [[20, 21, 22], [], [23], [24, 25]]  # the second row held
    seen = []
    tokens_as_step = cpu_step.tokens_as_step
    monkeypatch.setattr(cpu_step, "tokens_as_step", lambda *a: seen.append(tokens_as_step(*a)) or seen[-1])

    def fed(mode: str) -> list[torch.Tensor]:
        pool, runner = KVPool(model, 4, 32), ModelRunner(model)
        with torch.inference_mode():
            runner.feed(pool, prompts, slots=slots)
            if mode == "stepped":
                out = []
                for j in range(3):
                    step = [c[j : j + 1] for c in chunks]
                    out.append(runner.feed(pool, step, slots=slots)[0].float())
                return [out[j][i] for i, c in enumerate(chunks) for j in range(len(c))]
            if mode == "library":
                monkeypatch.setattr(cpu_step, "TOKEN_STEP_KEYS", 0)
            seen.clear()
            every = runner.feed(pool, chunks, slots=slots, every=True)[0].float()  # (b, Q, V)
            monkeypatch.setattr(cpu_step, "TOKEN_STEP_KEYS", 8192)
            assert seen == [mode == "tokens"]
            return [every[i, j] for i, c in enumerate(chunks) for j in range(len(c))]

    got, stepped, library = fed("tokens"), fed("stepped"), fed("library")
    for a, b, c in zip(got, stepped, library, strict=True):
        if cpu_linear.amx():
            assert torch.equal(a, b)
        torch.testing.assert_close(a, b, atol=0.025, rtol=0.01)
        torch.testing.assert_close(a, c, atol=0.025, rtol=0.01)

    lean = ModelRunner(model).lean
    with torch.enable_grad():
        assert not tokens_as_step(lean, 64)
    with torch.no_grad():
        assert tokens_as_step(lean, 8192) and not tokens_as_step(lean, 8193)
        assert not tokens_as_step(ModelRunner(build(family)).lean, 64)  # float32: the library kernel's sums
        assert not tokens_as_step(ModelRunner(build("qwen3").bfloat16()).lean, 64)  # per-head norms
        cpu_linear.use_step_ops(False)
        try:
            assert not tokens_as_step(lean, 64)
        finally:
            cpu_linear.use_step_ops(True)
