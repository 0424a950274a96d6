"""The guarded step: per-group clipping, learning-rate scaling that survives AdamW, skips."""

import copy
import math

import pytest
import torch

from hieragent.lightning.optim import guarded_step

LR, WD, BETAS, EPS = 0.05, 0.01, (0.9, 0.999), 1e-8


def make(seed=0):
    g = torch.Generator().manual_seed(seed)
    params = {name: torch.nn.Parameter(torch.randn(n, generator=g)) for name, n in (("policy", 7), ("value", 5))}
    opt = torch.optim.AdamW([{"params": [params["policy"]], "name": "policy"},
                             {"params": [params["value"]], "name": "value"}],
                            lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    return params, opt, g


def set_grads(params, g, scale=1.0):
    for p in params.values():
        p.grad = scale * torch.randn(p.shape, generator=g)


def twin(params, opt):
    """An independent copy of the parameters, their gradients and the optimizer state."""
    params2, opt2 = copy.deepcopy((params, opt))
    for k, p in params.items():
        params2[k].grad = p.grad.clone()
    return params2, opt2


def adamw_delta_float64(p, grad, exp_avg, exp_avg_sq, step, lr):
    """One AdamW update written out in float64 from the state before the step."""
    p, grad = p.double(), grad.double()
    m = BETAS[0] * exp_avg.double() + (1 - BETAS[0]) * grad
    v = BETAS[1] * exp_avg_sq.double() + (1 - BETAS[1]) * grad * grad
    m_hat, v_hat = m / (1 - BETAS[0] ** step), v / (1 - BETAS[1] ** step)
    return -lr * WD * p - lr * m_hat / (v_hat.sqrt() + EPS)


@pytest.mark.parametrize("scale", [0.3, 0.77, 0.0])
def test_a_learning_rate_scale_shrinks_the_parameter_change_by_exactly_that_factor(scale):
    params, opt, g = make()
    for _ in range(3):  # Adam history, so the moments are not those of a first step
        set_grads(params, g)
        guarded_step(opt, max_grad_norm=0)
    set_grads(params, g)
    twin_params, twin_opt = twin(params, opt)
    state = {k: v.clone() for k, v in opt.state[params["policy"]].items()}
    start = {k: p.detach().clone() for k, p in params.items()}
    grad = params["policy"].grad.clone()
    scaled = guarded_step(opt, max_grad_norm=0, lr_scales={"policy": scale})
    plain = guarded_step(twin_opt, max_grad_norm=0)
    delta = params["policy"].detach() - start["policy"]
    delta_plain = twin_params["policy"].detach() - start["policy"]
    want = adamw_delta_float64(start["policy"], grad, state["exp_avg"], state["exp_avg_sq"],
                               int(state["step"]) + 1, LR * scale)
    torch.testing.assert_close(delta.double(), want, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(delta, scale * delta_plain, rtol=1e-5, atol=1e-7)
    assert scaled.update_norms["policy"] == pytest.approx(scale * plain.update_norms["policy"], rel=1e-5, abs=1e-9)
    # the other group and the learning rates themselves are untouched
    torch.testing.assert_close(params["value"], twin_params["value"])
    assert [grp["lr"] for grp in opt.param_groups] == [LR, LR]
    assert scaled.lr_scales == {"policy": scale, "value": 1.0}


def test_scaling_the_gradient_instead_would_barely_move_an_adam_step():
    """Why the scale is on the learning rate: Adam divides the gradient by its own RMS."""
    params, opt, g = make()
    set_grads(params, g)
    twin_params, twin_opt = twin(params, opt)
    start = params["policy"].detach().clone()
    twin_params["policy"].grad.mul_(0.3)
    guarded_step(opt, max_grad_norm=0)
    guarded_step(twin_opt, max_grad_norm=0)
    full, shrunk = params["policy"] - start, twin_params["policy"] - start
    assert (full - shrunk).abs().max() < 1e-5 * full.abs().max()  # not 0.7x: float32 rounding only


def test_each_group_is_clipped_by_its_own_norm():
    params, opt, g = make()
    set_grads(params, g)
    params["value"].grad.mul_(1e4)  # a huge value loss
    policy_grad = params["policy"].grad.clone()
    norm_policy = float(policy_grad.norm())
    result = guarded_step(torch.optim.SGD(opt.param_groups, lr=1.0), max_grad_norm=2 * norm_policy)
    assert result.grad_norms["policy"] == pytest.approx(norm_policy, rel=1e-6)
    # the policy's gradient was under the limit: untouched by the value group's norm
    torch.testing.assert_close(params["policy"].grad, policy_grad)
    assert float(params["value"].grad.norm()) == pytest.approx(2 * norm_policy, rel=1e-5)
    assert result.grad_norm == pytest.approx(math.hypot(*result.grad_norms.values()), rel=1e-9)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_group_skips_the_step_and_touches_neither_weights_nor_state(bad):
    params, opt, g = make()
    set_grads(params, g)
    guarded_step(opt, max_grad_norm=1.0)
    before = {k: p.detach().clone() for k, p in params.items()}
    state = copy.deepcopy(opt.state_dict()["state"])
    set_grads(params, g)
    params["value"].grad[2] = bad
    result = guarded_step(opt, max_grad_norm=1.0, lr_scales={"policy": 0.5})
    assert result.skipped is not None and "value" in result.skipped
    assert all(torch.equal(before[k], p) for k, p in params.items())
    after = opt.state_dict()["state"]
    assert all(torch.equal(state[i][k], after[i][k]) for i in state for k in state[i])
    assert all(p.grad is None or not p.grad.any() for p in params.values())


def test_a_reason_given_skips_without_stepping_and_bad_scales_are_refused():
    params, opt, g = make()
    set_grads(params, g)
    before = params["policy"].detach().clone()
    assert guarded_step(opt, 1.0, skip="non-finite planner loss").skipped == "non-finite planner loss"
    assert torch.equal(before, params["policy"])
    set_grads(params, g)
    with pytest.raises(ValueError, match="group 'policy'"):
        guarded_step(opt, 1.0, lr_scales={"policy": 1.5})
