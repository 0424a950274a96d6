"""The KL reference: after a warm start it is the warm-start policy, frozen; else the base model."""

import pytest
import torch

from acting_helpers import act_on, prompt_ids
from hieragent.lightning.module import HierAgentModule
from hieragent.memory.settings import MemorySettings
from hieragent.models.lora import LoraSettings
from hieragent.rollout.loop import RolloutSettings


def module(**overrides):
    kwargs = dict(model="tiny", lora=LoraSettings(r=4, alpha=8), score_reduction="mean",
                  rollout=RolloutSettings(hierarchical=True), memory=MemorySettings(enabled=False))
    kwargs.update(overrides)
    return HierAgentModule(**kwargs)


@pytest.fixture()
def warm_checkpoint(tmp_path):
    """A checkpoint whose adapters are far from zero: what a supervised warm start leaves."""
    warm = module()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in warm.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    path = tmp_path / "warm.ckpt"
    state = {k: v for k, v in warm.state_dict().items() if "lora_" in k or "query_adapter" in k}
    torch.save({"state_dict": state}, path)
    return path


def turns_of(policy, texts):
    prompts = [prompt_ids(policy, t) for t in texts]
    return act_on(policy, prompts, [["turn left", "go forward", "pick up"]] * len(texts),
                  generator=torch.Generator().manual_seed(1))


def test_after_init_from_the_reference_is_the_warm_start_policy_and_stays_fixed(warm_checkpoint):
    rl = module(init_from=str(warm_checkpoint))
    base = module(init_from=str(warm_checkpoint), kl_reference="base")
    for role, policy in rl.policies():
        turns = turns_of(policy, ["Subgoal: go to the red ball", "Subgoal: open the door"])
        start = torch.cat(policy.turn_logprobs(turns)).detach()
        ref = torch.cat(policy.reference_logprobs(turns))
        torch.testing.assert_close(ref, start)  # the policy RL starts from
        base_policy = dict(base.policies())[role]
        base_ref = torch.cat(base_policy.reference_logprobs(turns))
        assert (base_ref - ref).abs().max() > 1e-3  # the model before the warm start differs
        with torch.no_grad():  # a training step moves the policy ...
            for name, p in rl.lm.named_parameters():
                if f".{role}." in name and "lora_A" in name:
                    p.add_(0.3)
        moved = torch.cat(policy.turn_logprobs(turns)).detach()
        assert (moved - start).abs().max() > 1e-3
        torch.testing.assert_close(torch.cat(policy.reference_logprobs(turns)), ref)  # ... not the reference


def test_reference_adapters_never_train_and_travel_in_the_checkpoint(warm_checkpoint):
    rl = module(init_from=str(warm_checkpoint))
    optimized = {id(p) for g in rl.configure_optimizers().param_groups for p in g["params"]}
    refs = {n: p for n, p in rl.named_parameters() if "_ref." in n}
    assert refs and not any(p.requires_grad or id(p) in optimized for p in refs.values())
    for role, policy in rl.policies():  # running the reference leaves the policy trainable
        policy.reference_logprobs(turns_of(policy, ["Subgoal: explore"]))
        policy.turn_logprobs(turns_of(policy, ["Subgoal: explore"]))
        assert all(p.requires_grad for n, p in rl.lm.named_parameters() if f".{role}." in n and "lora_" in n)
    saved = rl.state_dict()
    assert all(name in saved for name in refs)


def test_without_a_warm_start_the_reference_is_the_base_model(tiny_lm):
    fresh = module()
    for _, policy in fresh.policies():
        assert policy.reference_adapter is None
    with pytest.raises(ValueError, match="model.kl_reference"):
        module(kl_reference="sft")
