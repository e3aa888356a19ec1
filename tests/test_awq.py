"""AWQ: scale folding, GQA, the search against autoawq 0.2.9's on the same block, the GEMM layout."""
import copy
import gc
import json

import pytest
import torch

import quantkit
from quantkit import QuantkitError
from quantkit.exporters import awq as gemm
from quantkit.layers import linear_inputs
from quantkit.pipeline import Hessian, capture_inputs
from quantkit.quantizers import awq, rtn
from quantkit.quantizers.awq import fold, search_group

from .conftest import VALID, loaded, make_tiny
from .refs import autoawq, cpu_snapshots_copied


@pytest.fixture(scope="module")
def layer_and_batches(tiny_dir):
    m = loaded(tiny_dir)
    windows = torch.randint(0, 512, (4, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        batches = capture_inputs(m, windows, 2)
    return m, batches


def hessian(xs: list[torch.Tensor]) -> torch.Tensor:
    """H = 2 X^T X / T of the batches xs, GPTQ's: each linear's mean squared output error is tr(dW H dW^T) / 2T."""
    h = Hessian(xs[0].shape[-1])
    for x in xs:
        h.add_batch(x)
    return h.matrix()


def input_mean(xs: list[torch.Tensor]) -> torch.Tensor:
    return (sum(x.abs().reshape(-1, x.shape[-1]).sum(0).double() for x in xs) / sum(x[..., 0].numel() for x in xs)).float()


@pytest.fixture(scope="module")
def mha_dir(tmp_path_factory):
    """make_tiny's model without grouped-query attention: a kv head for each query head."""
    return make_tiny(tmp_path_factory.mktemp("mha") / "model", num_key_value_heads=4)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_folding_keeps_the_float_model(mha_dir, qwen3_dir, arch):
    """Each group's scales folded into the op before it leave the layer's function as it was (Qwen3:
    its q/k norms come after q_proj and k_proj; o_proj's scales fold into v_proj's rows where each
    o_proj input has a v_proj output of its own, as in this Llama, not under Qwen3's grouped-query
    attention)."""
    m = loaded(mha_dir if arch == "llama" else qwen3_dir)
    with torch.no_grad():
        batches = capture_inputs(m, torch.randint(0, 512, (2, 48), generator=torch.Generator().manual_seed(0)), 2)
    layer = m.layers[1]
    hidden, kwargs = batches[0]
    with torch.no_grad():
        before = layer(hidden, **kwargs)
        g = torch.Generator().manual_seed(1)
        attn, mlp = layer.self_attn, layer.mlp
        s = torch.rand(64, generator=g) + 0.5
        fold(layer.input_layernorm, [attn.q_proj, attn.k_proj, attn.v_proj], s)
        if arch == "llama":
            fold(attn.v_proj, [attn.o_proj], torch.rand(64, generator=g) + 0.5)
        s = torch.rand(64, generator=g) + 0.5
        fold(layer.post_attention_layernorm, [mlp.gate_proj, mlp.up_proj], s)
        s = torch.rand(128, generator=g) + 0.5
        fold(mlp.up_proj, [mlp.down_proj], s)
        after = layer(hidden, **kwargs)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_heads", [2, 4])
def test_o_proj_is_scaled_only_without_grouped_query_attention(tiny_dir, mha_dir, monkeypatch, kv_heads):
    """o_proj's scales fold into v_proj's rows where each o_proj input is a v_proj output of its own
    (4 kv heads for 4 query heads); under grouped-query attention (2) o_proj is not scaled, and its
    weight goes to the clipping search as it was."""
    m = loaded(mha_dir if kv_heads == 4 else tiny_dir)
    layer = m.layers[0]
    attn = layer.self_attn
    original = attn.o_proj.weight.detach().clone()
    folded, clipped = [], []
    monkeypatch.setattr(awq, "fold", lambda prev, lins, s: folded.append(prev) or fold(prev, lins, s))
    search_clip = awq.search_clip
    monkeypatch.setattr(awq, "search_clip", lambda w, *a, **k: clipped.append(w.clone()) or search_clip(w, *a, **k))
    windows = torch.randint(0, 512, (4, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        awq.quantize_layer(layer, capture_inputs(m, windows, 2), 4, 32, False, loss="output")
    assert len(folded) == (4 if kv_heads == 4 else 3) and (attn.v_proj in folded) == (kv_heads == 4)
    if kv_heads == 2:
        assert torch.equal(clipped[1], original)  # clipped: v, o, gate, up, down (not q, k)


def reference_quantizer(bits, group_size):
    AwqQuantizer = autoawq("quantize.quantizer").AwqQuantizer
    q = AwqQuantizer.__new__(AwqQuantizer)
    q.w_bit, q.group_size, q.zero_point, q.duo_scaling = bits, group_size, True, False
    q.max_chunk_memory, q.n_parallel_calib_samples = 2**30, None
    return q


@pytest.mark.parametrize("duo", [False, True])
def test_scales_match_autoawq(tiny_dir, duo):
    """Same block, same activations: the same grid point as autoawq, or (where two points are a near
    tie, since our grid rounds its scale to float16 and always spans 0) a block loss no worse."""
    m = loaded(tiny_dir)
    layer = m.layers[0]
    x = torch.randn(4, 48, 64, generator=torch.Generator().manual_seed(2)) * torch.linspace(0.1, 3, 64)
    with torch.no_grad():
        batches = capture_inputs(m, torch.randint(0, 512, (4, 48), generator=torch.Generator().manual_seed(0)), 4)
    kw = {k: v for k, v in batches[0][1].items() if k in ("position_embeddings", "attention_mask")}
    ref = reference_quantizer(4, 32)
    ref.duo_scaling = duo
    attn, mlp = layer.self_attn, layer.mlp
    cases = [  # prev op, linears, the block judged (ours, theirs), its input
        (layer.input_layernorm, [attn.q_proj, attn.k_proj, attn.v_proj],
         lambda x, kw: attn(hidden_states=x, **kw)[0], attn, x),
        (layer.post_attention_layernorm, [mlp.gate_proj, mlp.up_proj], lambda x, kw: mlp(x), mlp, x),
        (mlp.up_proj, [mlp.down_proj], lambda x, kw: mlp.down_proj(x), mlp.down_proj,
         torch.relu(torch.randn(4, 48, 128, generator=torch.Generator().manual_seed(3))) * torch.linspace(0.1, 2, 128)),
    ]
    same = 0
    for prev, linears, block, module, inp in cases:
        with torch.no_grad():
            ours = search_group(linears, [inp], input_mean([inp]), [kw], block, hessian([inp]), 4, 32, False, duo=duo)
            with cpu_snapshots_copied():
                _, _, theirs = ref._search_best_scale(layer, prev, linears, inp, module2inspect=module, kwargs=dict(kw))
        if torch.allclose(ours, theirs.float(), rtol=1e-5):
            same += 1
            continue
        # a near tie: judge both with the same loss
        def loss(s):
            originals = [lin.weight.data for lin in linears]
            for lin in linears:
                lin.weight.data = awq.fake_quantize(lin.weight * s, 4, 32) / s
            err = (block(inp, kw) - out).pow(2).mean().item()
            for lin, w in zip(linears, originals):
                lin.weight.data = w
            return err
        with torch.no_grad():
            out = block(inp, kw)
            assert loss(ours) <= loss(theirs.float()) <= loss(ours) * 1.01
    assert same >= 2  # a tie-break may differ once; a wrong formula would differ everywhere


def test_output_loss_is_the_block_loss_of_a_lone_linear(layer_and_batches):
    """A group of one linear (o_proj, down_proj) is judged through its inputs' Hessian: the same
    losses, so the same scales, as running the linear on every token per candidate."""
    m, batches = layer_and_batches
    layer = m.layers[0]
    inputs = linear_inputs(layer, batches, ["self_attn.o_proj", "mlp.down_proj"])
    kw = [k for _, k in batches]
    with torch.no_grad():
        for lin in (layer.self_attn.o_proj, layer.mlp.down_proj):
            xs = inputs[[n for n, mod in layer.named_modules() if mod is lin][0]]
            block = awq.block_loss([lin], xs, kw, lambda x, _: lin(x), 4, 32, False)
            h = hessian(xs)
            output = awq.output_loss([lin], h, 4, 32, False)
            x_mean = torch.rand(lin.in_features, generator=torch.Generator().manual_seed(6)) + 0.1
            for alpha in (0.0, 0.3, 0.6, 0.9):
                s = awq.candidate(x_mean, None, alpha)
                assert output(s) == pytest.approx(block(s), rel=1e-4)
            mean = input_mean(xs)
            ours = search_group([lin], xs, mean, kw, None, h, 4, 32, False)
            assert torch.equal(ours, search_group([lin], xs, mean, kw, lambda x, _: lin(x), h, 4, 32, False))


@pytest.mark.parametrize("k, blocks", [(37, 8), (64, 8), (5, 8), (40, 1)])
def test_quadratic_form_from_the_upper_blocks_equals_the_full_product(k, blocks):
    g = torch.Generator().manual_seed(k)
    x, dw = torch.randn(3 * k, k, generator=g, dtype=torch.float64), torch.randn(7, k, generator=g, dtype=torch.float64)
    h = x.T @ x
    assert awq.quadratic(dw, h, blocks) == pytest.approx(((dw @ h) * dw).sum().item(), rel=1e-12)


def test_the_descent_judges_few_candidates_and_crosses_a_narrow_dip():
    """With a start loss, the block loss is judged only on the way down from the start's best: on a
    loss falling from index 4 to 13 with a dip one step wide on the way (7 lower than 8), the descent
    reaches 13, the exhaustive search's choice, in fewer evaluations; at a local minimum with nothing
    lower within two steps (6) it stops, where the exhaustive search goes on to 13."""
    x_mean = torch.tensor([1.0, torch.e])  # candidate(x_mean, None, a) is [e^(-a/2), e^(a/2)]

    def index(s):  # the candidate's alpha * 20
        return round(float(2 * s[1].log()) * 20)

    def judged(values):
        calls = []

        def loss(s):
            calls.append(index(s))
            return values[index(s)]
        return loss, calls

    falling = [abs(i - 13) + 10 * (i < 4) - 1.5 * (i == 7) for i in range(20)]
    start = lambda s: abs(index(s) - 4)  # noqa: E731  the cheap loss ranks index 4 best
    for values, expected in ((falling, 13), ([abs(i - 13) - 6 * (5 <= i <= 6) for i in range(20)], 6)):
        loss, calls = judged(values)
        _, alpha, losses = awq.search_scale(x_mean, loss, 20, start=start)
        assert round(alpha * 20) == expected and len(calls) == len(set(calls)) == len(losses) < 20, calls
        _, exhaustive, _ = awq.search_scale(x_mean, judged(values)[0], 20)
        assert round(exhaustive * 20) == 13


def test_the_coarse_search_of_a_smooth_loss_finds_a_minimum_beside_the_second_best_even():
    """An o_proj curve seen at w4: the least (3) sits beside the second-best even candidate (4), not the
    best (6); the coarse search finds it in fewer evaluations, the exhaustive one tries all 20."""
    values = [1.0629, 1.0278, 1.0267, 1.0, 1.024, 1.0281, 1.0198, 1.057] + [1.1 + i / 10 for i in range(12)]
    for smooth, evaluations in ((True, 13), (False, 20)):
        tried = []
        assert awq.least(lambda i: tried.append(i) or values[i], 20, smooth) == 3
        assert len(set(tried)) == evaluations


def test_the_attention_is_judged_on_the_first_windows_of_a_batch(layer_and_batches):
    """head takes a batch's first windows and the keyword arguments' rows per window alike; Llama's
    attention on them gives those windows' outputs of the whole batch."""
    m, batches = layer_and_batches
    hidden, kwargs = batches[0]  # 2 windows of 48 tokens
    x, kw = awq.head(hidden, kwargs, 60)
    assert torch.equal(x, hidden[:1]) and kw.keys() == kwargs.keys()
    cos, sin = kwargs["position_embeddings"]  # one row, broadcast over the windows: kept whole
    assert kw["position_embeddings"][0] is cos and kw["position_embeddings"][1] is sin
    assert awq.head(hidden, kwargs, 96)[0] is hidden
    attn = m.layers[0].self_attn
    with torch.no_grad():
        whole, first = attn(hidden_states=hidden, **kwargs)[0], attn(hidden_states=x, **kw)[0]
    torch.testing.assert_close(first, whole[:1], rtol=1e-5, atol=1e-6)
    mask = torch.zeros(2, 1, 48, 48)
    _, kw = awq.head(hidden, {"attention_mask": mask, "position_embeddings": (mask, mask[:1]), "use_cache": False}, 48)
    assert kw["attention_mask"].shape[0] == 1 and [t.shape[0] for t in kw["position_embeddings"]] == [1, 1]
    assert kw["use_cache"] is False


def test_a_search_judges_the_attention_on_its_first_windows_and_an_output_loss_coarse_to_fine(layer_and_batches,
                                                                                             monkeypatch):
    m, batches = layer_and_batches  # batches of 2 windows of 48 tokens
    layer = m.layers[0]
    attn = layer.self_attn
    lins = [attn.q_proj, attn.k_proj, attn.v_proj]
    windows, products = [], []
    block = lambda x, k: windows.append(len(x)) or attn(hidden_states=x, **k)[0]  # noqa: E731
    quadratic = awq.quadratic
    monkeypatch.setattr(awq, "quadratic", lambda dw, h: products.append(1) or quadratic(dw, h))
    with torch.no_grad():
        g = awq.gather(layer, batches, ["head", None, None, None], 8192, 48)[0]
        h, mean = g.h.matrix(), g.mean()
        search_group(lins, g.xs, mean, g.kwargs, block, h, 4, 32, False, descent=True)
        assert set(windows) == {1} and 12 <= len(products) <= 14  # the start, coarse to fine
        products.clear()
        search_group(lins, g.xs, mean, g.kwargs, None, h, 4, 32, False)
    assert 12 <= len(products) <= 14


@pytest.mark.parametrize("group_size", [32, 40, -1])  # 40: a shorter last group
def test_fake_quantize_is_rtns_round_trip(group_size):
    w = torch.randn(40, 96, generator=torch.Generator().manual_seed(7))
    for sym in (False, True):
        assert torch.equal(awq.fake_quantize(w, 3, group_size, sym), rtn.quantize(w, 3, group_size, sym).dequantize())


def test_clip_matches_autoawq():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(128, 256, generator=g) * 0.05
    w[:, 7] *= 8  # an outlier column makes clipping worthwhile
    x = torch.randn(600, 256, generator=g)
    ours = awq.search_clip(w, hessian([x]), 4, 64)
    theirs = reference_quantizer(4, 64)._compute_best_clip(w, x)  # it samples every token here too (600 // 512 = 1)
    theirs = theirs.squeeze(-1)
    agree = torch.isclose(ours, theirs, rtol=1e-6)
    assert agree.float().mean() > 0.9, agree.float().mean()
    assert (ours < w.abs().reshape(128, 4, 64).amax(-1)).any()  # some groups are clipped

    def err(bound):  # per (row, group) output error of each choice, with our quantizer
        q = awq.quantize(w, 4, 64, False, bound).dequantize()
        return torch.stack([(xc @ (qc - wc).T).pow(2).mean(0) for xc, qc, wc in
                            zip(x.split(64, 1), q.split(64, 1), w.split(64, 1))], dim=1)

    assert (err(ours)[~agree] <= err(theirs)[~agree] * (1 + 1e-6)).all()


def test_clip_is_judged_on_the_grid_it_is_quantized_on():
    """--sym: the clipping bounds were searched on the asymmetric grid, then quantized on the symmetric one.
    On the symmetric grid, each (row, group)'s bound now gives the least of the candidates' output errors."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(128, 256, generator=g) * 0.05
    w[:, 7] *= 8
    x = torch.randn(600, 256, generator=g)
    h = hessian([x])

    def err(bound):  # each (row, group)'s share of the output error, as the search judges it
        dw = awq.quantize(w, 4, 64, True, bound).dequantize() - w
        return torch.stack([((d @ h[c:c + 64, c:c + 64]) * d).sum(1) for c, d in zip(range(0, 256, 64), dw.split(64, 1))],
                           dim=1)

    on_sym, on_asym = err(awq.search_clip(w, h, 4, 64, sym=True)), err(awq.search_clip(w, h, 4, 64))
    assert (on_sym <= on_asym * (1 + 1e-6)).all()
    assert on_sym.sum() < 0.99 * on_asym.sum(), (on_sym.sum(), on_asym.sum())


@pytest.mark.parametrize("model", ["tiny_dir", "qwen3_dir"])
def test_awq_beats_nothing_on_gqa_model_and_exports(request, tmp_path, model):
    m = quantkit.quantize(str(request.getfixturevalue(model)), method="awq", bits=4, group_size=32, calib_data=VALID,
                          calib_samples=8, calib_seqlen=64, out=tmp_path / "gptq-layout", keep=True, progress=False)
    assert m.qconfig.sym is False  # zero points by default, as AWQ
    qt = m.tensors["model.layers.0.self_attn.o_proj"]
    assert not qt.sym and qt.group_size == 32
    for name, qt in m.tensors.items():  # what is scored in memory is what is written: every fold came first
        assert torch.equal(m.module.get_submodule(name).weight.data, qt.dequantize()), name
    quantkit.export(m, tmp_path / "awq", "awq")
    cfg = json.loads((tmp_path / "awq" / "config.json").read_text())["quantization_config"]
    assert cfg == {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm",
                   "modules_to_not_convert": None}
    for layout in ("gptq-layout", "awq"):
        back = quantkit.load(tmp_path / layout)
        for name, qt in m.tensors.items():
            assert torch.equal(back.tensors[name].dequantize(), qt.dequantize()), (layout, name)
        # the folded norms travel with the checkpoint (float16)
        norm = "model.layers.0.input_layernorm.weight"
        assert torch.equal(back.module.state_dict()[norm], m.module.state_dict()[norm].half().float())


def test_gemm_packing_equals_autoawq():
    WQLinear_GEMM = autoawq("modules.linear.gemm").WQLinear_GEMM
    dequantize_gemm = autoawq("utils.packing_utils").dequantize_gemm
    g = torch.Generator().manual_seed(5)
    w = torch.randn(96, 128, generator=g)
    qt = awq.quantize(w, 4, 32)
    linear = torch.nn.Linear(128, 96, bias=False)
    linear.weight.data = qt.dequantize()
    theirs = WQLinear_GEMM.from_linear(linear, 4, 32, scales=qt.scales.T.contiguous(), zeros=qt.zeros.T.int().contiguous())
    assert torch.equal(gemm.pack(qt.codes.T.contiguous()), theirs.qweight)
    assert torch.equal(gemm.pack(qt.zeros.T.contiguous()), theirs.qzeros)
    assert torch.equal(gemm.unpack(theirs.qweight), qt.codes.T)
    deq = dequantize_gemm(theirs.qweight, theirs.qzeros, qt.scales.T.contiguous(), 4, 32)
    torch.testing.assert_close(deq.float().T, qt.dequantize(), rtol=1e-3, atol=1e-3)  # theirs is float16


@pytest.mark.parametrize("args,match", [
    (dict(bits=3), "4-bit weights only"),
    (dict(group_size=-1), "one group size"),
    (dict(group_size=48), "group size to divide"),
    (dict(method="nf4", group_size=128), "integer grids"),  # its default group size: nf4 reads none
])
def test_awq_layout_refuses(tiny_dir, tmp_path, args, match):
    kw = dict(method="awq", bits=4, group_size=32, calib_data=VALID, calib_samples=4, calib_seqlen=32) | args
    with pytest.raises(QuantkitError, match=match):
        quantkit.quantize(str(tiny_dir), out=tmp_path / "q", format="awq", progress=False, **kw)
    assert not (tmp_path / "q").exists()


def test_unknown_layer_layout_is_refused(layer_and_batches):
    m, batches = layer_and_batches
    layer = m.layers[0]
    saved = layer.post_attention_layernorm
    del layer.post_attention_layernorm
    try:
        with pytest.raises(QuantkitError, match="post_attention_layernorm.*Llama, Mistral and Qwen2"):
            awq.quantize_layer(layer, batches, 4, 32, False, loss="descent")
    finally:
        layer.post_attention_layernorm = saved


def test_each_layer_is_calibrated_on_the_quantized_outputs_of_the_one_before(tiny_dir):
    from quantkit.calibration import load_text, sample_windows
    from quantkit.pipeline import quantize_layers

    m = loaded(tiny_dir)
    windows = sample_windows(m.tokenizer, load_text(VALID), 4, 48, seed=1)
    seen = {}

    def layer_fn(i, layer, batches):
        seen[i] = torch.cat([h for h, _ in batches])
        return awq.quantize_layer(layer, batches, 4, 32, False, loss="descent", prefix=f"model.layers.{i}.")

    quantize_layers(m, None, windows, batch_size=2, progress=False, layer_fn=layer_fn)
    got = []  # layer 1's inputs in the finished model: layer 0 quantized, its norms folded
    hook = m.layers[1].register_forward_pre_hook(
        lambda mod, args, kwargs: got.append(args[0] if args else kwargs["hidden_states"]), with_kwargs=True)
    with torch.no_grad():
        m.module(windows, use_cache=False)
    hook.remove()
    torch.testing.assert_close(seen[1], got[0], rtol=1e-4, atol=1e-5)
    assert not torch.allclose(seen[1], seen[0], rtol=1e-2, atol=1e-3)


def test_gathered_statistics_are_those_of_all_inputs(layer_and_batches):
    """What each group's searches take, gathered batch by batch from one float run that stops at the
    MLP's input, equals what the whole inputs give: mean |x|, the Hessian of rows spread over all
    batches, the attention's first windows, the MLP's rows spread over all batches; down_proj's come from
    the MLP run on gate/up's Hessian rows alone."""
    m, batches = layer_and_batches  # 2 batches of 2 windows of 48 tokens
    layer = m.layers[1]
    names = [group[0] for group in awq.GROUPS]
    rows_run = []
    handles = [layer.mlp.gate_proj.register_forward_hook(lambda _, args, out: rows_run.append(len(args[0]))),
               layer.mlp.down_proj.register_forward_hook(lambda *_: rows_run.append(-1))]
    try:
        with torch.no_grad():
            whole = linear_inputs(layer, batches, names)
            rows_run.clear()
            gathered = awq.gather(layer, batches, ["head", None, "spread", None], 40, 48)
    finally:
        for handle in handles:
            handle.remove()
    step = 5  # 192 tokens // 40 is 4, which divides the windows' 48 tokens; 5 shares no factor with it
    assert rows_run == [20, 20]  # gate/up (and no down_proj) ran on every 5th row of each batch of 96 alone
    for name, g in zip(names[:-1], gathered):
        xs = whole[name]
        assert torch.equal(g.mean(), input_mean(xs)), name
        assert torch.equal(g.h.matrix(), hessian([x.reshape(-1, x.shape[-1])[::step] for x in xs])), name
    down = [x.reshape(-1, x.shape[-1])[::step] for x in whole[names[-1]]]
    torch.testing.assert_close(gathered[-1].mean(), input_mean(down), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(gathered[-1].h.matrix(), hessian(down), rtol=1e-4, atol=1e-6)
    attention, mlp = gathered[0], gathered[2]
    assert len(attention.xs) == 1 and torch.equal(attention.xs[0], whole[names[0]][0][:1])  # 48 tokens: one window
    assert attention.kwargs[0].keys() == batches[0][1].keys()
    rows = [x.reshape(-1, x.shape[-1])[::5] for x in whole[names[2]]]  # every 5th row of each batch (192 // 48 is 4)
    assert len(mlp.xs) == 2 and all(torch.equal(a, b) for a, b in zip(mlp.xs, rows, strict=True))
    for kept in attention.xs + mlp.xs:  # copies: a view would keep its whole batch
        assert kept.untyped_storage().nbytes() == kept.numel() * kept.element_size()
    assert gathered[1].xs == gathered[3].xs == []


@pytest.mark.parametrize("tokens", [48, 96, 200])
def test_rows_spread_over_the_batches_take_every_position_in_a_window_alike(tokens):
    """A step dividing the window length took the same positions of every window: at 128 x 512 tokens,
    every 8th row gave the windows' first tokens (the attention's sink, with the largest activations)
    8 times their share of AWQ's Hessians."""
    xs = [torch.zeros(8, 48, 2)] * 4  # 4 batches of 8 windows of 48 tokens
    step = awq.spacing(xs, tokens)
    assert step >= 1536 // tokens
    positions = torch.arange(0, 8 * 48, step) % 48  # a batch's rows, by position in their window
    counts = torch.bincount(positions, minlength=48)
    assert counts.max() - counts.min() <= 1, (step, counts)


def test_no_batchs_inputs_are_held_through_the_searches(layer_and_batches, monkeypatch):
    """AWQ takes what its searches need from each batch's inputs as the batch runs: holding all of them
    took 6.5 times the hidden states, 13 GiB for a 70B layer at 128 x 512 calibration tokens."""
    m, batches = layer_and_batches
    layer = copy.deepcopy(m.layers[0])
    shape = batches[0][0].shape[:2]

    def batch_sized() -> set[int]:  # the tensors of a whole batch's tokens alive
        gc.collect()
        return {id(o) for o in gc.get_objects() if issubclass(type(o), torch.Tensor) and o.dim() == 3 and o.shape[:2] == shape}

    before, held = batch_sized(), []
    search = awq.search_group
    monkeypatch.setattr(awq, "search_group", lambda *a, **k: held.append(len(batch_sized() - before)) or search(*a, **k))
    with torch.no_grad():
        awq.quantize_layer(layer, batches, 4, 32, False, loss="descent", block_tokens=48)
    assert len(held) == 3 and held[0] == 0, held  # q/k/v, gate/up, down: no o_proj under grouped-query attention


def test_the_mlp_is_judged_on_tokens_spread_over_all_batches(layer_and_batches):
    """The MLP works on each token alone, so its block loss may take tokens from every batch: with all
    of them it chooses what the loss over whole batches chooses; with a few, the block sees only those."""
    m, batches = layer_and_batches
    layer = m.layers[1]
    mlp = layer.mlp
    xs = linear_inputs(layer, batches, ["mlp.gate_proj"])["mlp.gate_proj"]
    lins, kw = [mlp.gate_proj, mlp.up_proj], [k for _, k in batches]
    seen = []
    block = lambda x, _: seen.append(x.reshape(-1, x.shape[-1]).shape[0]) or mlp(x)  # noqa: E731
    with torch.no_grad():
        h, mean = hessian(xs), input_mean(xs)
        whole = search_group(lins, xs, mean, kw, block, h, 4, 32, False)
        g = awq.gather(layer, batches, [None, None, "spread", None], 8192, 10**6)[2]
        spread = search_group(lins, g.xs, mean, g.kwargs, block, h, 4, 32, False)
        assert torch.equal(whole, spread)
        seen.clear()
        g = awq.gather(layer, batches, [None, None, "spread", None], 8192, 40)[2]
        search_group(lins, g.xs, mean, g.kwargs, block, h, 4, 32, False)
    rows = [len(r) for r in g.xs]  # a forward per batch, on its share of the rows
    assert seen == rows * (len(seen) // len(rows)) and 0 < sum(rows) < sum(x[..., 0].numel() for x in xs)


def test_awq_loss_defaults_to_the_descent_for_awq_only():
    for bits in (3, 4, 8):
        assert quantkit.QuantConfig(method="awq", bits=bits).awq_loss == "descent"
    assert quantkit.QuantConfig(method="awq", bits=3, awq_loss="block").awq_loss == "block"
    assert quantkit.QuantConfig(method="gptq").awq_loss is None
    with pytest.raises(QuantkitError, match="use it with method='awq'"):
        quantkit.QuantConfig(method="gptq", awq_loss="block")
