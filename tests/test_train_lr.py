"""train.lr against diffusers' get_scheduler (a LambdaLR stepped once per optimizer step, as the scripts
do on one process), and train.optimizer against torch's clip_grad_norm_ + AdamW."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from diffusers.optimization import get_scheduler

from sdx.errors import SdxError
from train import lr as lrlib
from train import optimizer as optlib

PEAK = 3e-4
CASES = {
    "constant": ("constant", {}),
    "constant_with_warmup": ("constant_with_warmup", {"warmup": 7}),
    "constant_with_warmup_0": ("constant_with_warmup", {"warmup": 0}),
    "linear": ("linear", {"warmup": 7, "total": 30}),
    "linear_no_warmup": ("linear", {"warmup": 0, "total": 30}),
    "linear_all_warmup": ("linear", {"warmup": 30, "total": 30}),
    "cosine": ("cosine", {"warmup": 5, "total": 30}),
    "cosine_restarts": ("cosine_with_restarts", {"warmup": 5, "total": 30, "cycles": 3}),
    "cosine_restarts_1": ("cosine_with_restarts", {"warmup": 0, "total": 31, "cycles": 1}),
    "polynomial": ("polynomial", {"warmup": 5, "total": 30}),
    "polynomial_2": ("polynomial", {"warmup": 0, "total": 30, "power": 2.0}),
    "piecewise": ("piecewise_constant", {"rules": "1:10,0.1:20,0.01:30,0.005"}),
}
STEPS = 40  # past the end of every schedule


def ours(name, kw, peak=PEAK):
    return lrlib.schedule(name, peak, warmup_steps=kw.get("warmup", 0), total_steps=kw.get("total"),
                          num_cycles=kw.get("cycles", 1), power=kw.get("power", 1.0), step_rules=kw.get("rules"))


def torch_lrs(name, kw, optimizer_cls=torch.optim.SGD, peak=PEAK):
    """The learning rate each of STEPS optimizer steps uses, read as the scripts' loop would."""
    param = torch.nn.Parameter(torch.zeros(1))
    opt = optimizer_cls([param], lr=peak)
    sched = get_scheduler(name, opt, step_rules=kw.get("rules"), num_warmup_steps=kw.get("warmup"),
                          num_training_steps=kw.get("total"), num_cycles=kw.get("cycles", 1),
                          power=kw.get("power", 1.0))
    lrs = []
    for _ in range(STEPS):
        lrs.append(sched.get_last_lr()[0])
        param.grad = torch.ones(1)
        opt.step()
        sched.step()
    return np.array(lrs)


@pytest.mark.parametrize("case", list(CASES))
def test_schedule_matches_get_scheduler(case):
    name, kw = CASES[case]
    fn = ours(name, kw)
    got = np.asarray(jax.jit(jax.vmap(fn))(jnp.arange(STEPS)))
    assert got.dtype == np.float32
    want = torch_lrs(name, kw)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * PEAK)
    assert float(fn(3)) == pytest.approx(want[3], rel=1e-6, abs=1e-6 * PEAK)  # Python ints too


@pytest.mark.parametrize("case", ["linear", "cosine_restarts", "polynomial"])
def test_optax_count_uses_the_lr_of_that_step(case):
    """The update optax's count k applies is the one torch's optimizer step k applies (SGD, gradient 1)."""
    name, kw = CASES[case]
    tx = optax.sgd(ours(name, kw))
    params = jnp.zeros(())
    state = tx.init(params)
    deltas = []
    for _ in range(STEPS):
        updates, state = tx.update(jnp.ones(()), state, params)
        deltas.append(-float(updates))
    np.testing.assert_allclose(deltas, torch_lrs(name, kw), rtol=1e-6, atol=1e-6 * PEAK)


def test_bad_schedules_are_errors():
    with pytest.raises(SdxError, match="'cosine_with_hard_restarts'"):
        lrlib.schedule("cosine_with_hard_restarts", 1e-4)
    with pytest.raises(SdxError, match="number of training steps"):
        lrlib.schedule("cosine", 1e-4, warmup_steps=10)
    with pytest.raises(SdxError, match="lr_end"):
        lrlib.schedule("polynomial", 1e-8, total_steps=10)
    with pytest.raises(SdxError, match="must exceed"):
        lrlib.schedule("polynomial", 1e-4, warmup_steps=10, total_steps=10)
    with pytest.raises(SdxError, match="step_rules"):
        lrlib.schedule("piecewise_constant", 1e-4, step_rules="1:x,0.1")


def test_a_schedule_holds_only_what_its_curve_reads():
    """Runs that differ in a setting their curve ignores (a constant rate's --max_train_steps) get equal
    schedules, and so the same compiled step (`pipelines.executables` keys it by the schedule's fields)."""
    assert lrlib.schedule("constant", 1e-4, total_steps=12) == lrlib.schedule("constant", 1e-4, total_steps=1000)
    assert (lrlib.schedule("constant_with_warmup", 1e-4, warmup_steps=3, total_steps=12, power=2.0)
            == lrlib.schedule("constant_with_warmup", 1e-4, warmup_steps=3, total_steps=1000))
    assert lrlib.schedule("cosine", 1e-4, total_steps=12) != lrlib.schedule("cosine", 1e-4, total_steps=1000)
    assert (lrlib.schedule("piecewise_constant", 1e-4, step_rules="1:10,0.1", warmup_steps=5)
            != lrlib.schedule("piecewise_constant", 1e-4, step_rules="1:20,0.1"))


def test_scale_lr():
    assert lrlib.scale_lr(1e-4, accumulation=4, batch_size=8, devices=2) == pytest.approx(1e-4 * 64)


# ------------------------------------------------------------------------------------------------------
# Optimizer


@pytest.mark.parametrize("frozen, b_lr", [((), None), (("b",), None), ((), 3e-3)], ids=["all", "b_frozen", "b_group"])
@pytest.mark.parametrize("max_grad_norm", [1.0, 100.0, None])
def test_adamw_matches_torch(max_grad_norm, frozen, b_lr):
    """clip_grad_norm_ + AdamW under diffusers' cosine schedule with warm-up, on the same gradients. With
    `frozen` names, torch's optimizer and clipping get the other parameters only (optimizer.FrozenExcept):
    "b"'s large gradients must neither move it nor enter the clipping norm. With `b_lr`, "b" is a parameter
    group of that learning rate under the same scheduler (optimizer.ScaledLearningRates: --text_encoder_lr)."""
    rng = np.random.default_rng(0)
    shapes = {"w": (4, 3), "b": (3,), "tiny": (2,)}
    scale = {"w": 3.0, "b": 3.0, "tiny": 1e-6}  # "tiny": sqrt(v) ~ eps, where eps's placement shows
    init = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    grads = [{k: (rng.standard_normal(s) * scale[k]).astype(np.float32) for k, s in shapes.items()} for _ in range(8)]
    hp = {"beta1": 0.9, "beta2": 0.99, "weight_decay": 0.05, "eps": 1e-6}
    kw = {"warmup": 2, "total": 8}

    tparams = {k: torch.nn.Parameter(torch.from_numpy(v.copy())) for k, v in init.items()}
    trained = [p for k, p in tparams.items() if k not in frozen]
    groups = [{"params": trained}]
    if b_lr is not None:
        groups = [{"params": [p for k, p in tparams.items() if k != "b"]}, {"params": [tparams["b"]], "lr": b_lr}]
    topt = torch.optim.AdamW(groups, lr=1e-2, betas=(hp["beta1"], hp["beta2"]),
                             weight_decay=hp["weight_decay"], eps=hp["eps"])
    tsched = get_scheduler("cosine", topt, num_warmup_steps=kw["warmup"], num_training_steps=kw["total"])

    plain = optlib.AdamW(ours("cosine", kw, peak=1e-2), max_grad_norm=max_grad_norm, **hp)
    tx = optlib.FrozenExcept(plain, {k: k in frozen for k in shapes}) if frozen else plain
    if b_lr is not None:
        tx = optlib.ScaledLearningRates(tx, {k: b_lr / 1e-2 if k == "b" else 1.0 for k in shapes})
    params = {k: jnp.asarray(v) for k, v in init.items()}
    state = tx.init(params)
    step = jax.jit(lambda p, s, g: (lambda u, s: (optax.apply_updates(p, u), s))(*tx.update(g, s, p)))
    for g in grads:
        for k, p in tparams.items():
            p.grad = torch.from_numpy(g[k].copy())
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(trained, max_grad_norm)
        topt.step()
        tsched.step()
        params, state = step(params, state, {k: jnp.asarray(v) for k, v in g.items()})
        for k, p in tparams.items():
            np.testing.assert_allclose(params[k], p.detach().numpy(), rtol=1e-6, atol=1e-6, err_msg=k)
    for k in frozen:
        assert np.array_equal(params[k], init[k]), k
    size = lambda tree: sum(x.size for x in jax.tree.leaves(tree))
    assert size(state) == size(plain.init({k: init[k] for k in shapes if k not in frozen}))  # no moments for frozen


def test_clip_grad_norm_matches_torch():
    rng = np.random.default_rng(1)
    grads = {"a": rng.standard_normal((5, 5)).astype(np.float32), "b": rng.standard_normal(7).astype(np.float32)}
    tensors = [torch.from_numpy(v.copy()) for v in grads.values()]
    params = [torch.nn.Parameter(torch.zeros_like(t)) for t in tensors]
    for p, t in zip(params, tensors):
        p.grad = t
    torch.nn.utils.clip_grad_norm_(params, 0.5)
    clipped, _ = optlib.clip_grad_norm(0.5).update({k: jnp.asarray(v) for k, v in grads.items()}, optax.EmptyState())
    for k, p in zip(grads, params):
        np.testing.assert_allclose(clipped[k], p.grad.numpy(), rtol=1e-6, atol=1e-7)
