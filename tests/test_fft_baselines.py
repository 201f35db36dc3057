"""OvA-LP's two encoder fine-tuning baselines as ``--peft`` kinds: FFT-MoE (``moe``: routed LoRA experts) and PFPT
(``pfpt``: prompts aligned across clients into a pool). Random-init timm test models and scikit-learn's digits
(offline)."""

from __future__ import annotations

import pytest
import torch

from extract.encoders import load_encoder
from fedhead.core.fftmoe import MoE, MoELoRA, moe_layers
from fedhead.core.peft import FineTuned, TuneSpec, attach, trainable, trainable_vector
from fedhead.core.pfpt import PFPT, align_prompts
from fedhead.infra.errors import FedheadError
from fedhead.scratch.finetune import FinetuneConfig, run_finetune

TINY = dict(dataset="digits", data_dir=None, encoder="test_vit", pretrained=False, image_size=32, limit=120,
            clients=3, rounds=1, batch_size=32, plots=False)  # fmt: skip


def model_of(encoder: str = "test_vit") -> FineTuned:
    enc = load_encoder(encoder, pretrained=False, image_size=32)
    return FineTuned(enc.model, enc.feature_dim, 10, 32).eval()


# ---------------------------------------------------------------- moe


@pytest.mark.parametrize("encoder", ["test_vit", "test_efficientnet"])
def test_moe_with_b_zero_leaves_the_outputs_unchanged_and_trains_only_experts_and_routers(encoder):
    model = model_of(encoder)
    x = torch.randn(2, 3, 32, 32)
    before = model.features(x)
    tuning = attach(model, TuneSpec(peft="moe", experts=3, top_k=2, lora_rank=2), seed=0)
    assert isinstance(tuning, MoE) and moe_layers(model)
    assert torch.equal(model.eval().features(x), before)
    names = [n for n, _ in trainable(model)]
    assert all(n.rsplit(".", 1)[-1] in ("lora_A", "lora_B", "router") or n.startswith("classifier.") for n in names)
    assert all(not m.lora_B.detach().any() and m.lora_A.detach().abs().sum() > 0 for m in moe_layers(model))


def test_moe_routes_every_token_to_exactly_top_k_experts_and_its_aux_loss_is_positive():
    model = model_of()
    attach(model, TuneSpec(peft="moe", experts=4, top_k=2, lora_rank=2), seed=1)
    with torch.no_grad():  # non-zero experts, so the routing changes the output
        for m in moe_layers(model):
            m.lora_B.normal_(0, 0.1)
    x = torch.randn(3, 3, 32, 32)
    loss = model(x).sum()
    aux = MoE().aux_loss(model)
    for m in moe_layers(model):
        g = m.last_gates
        assert ((g > 0).sum(1) == 2).all()  # exactly k experts per token
        assert torch.allclose(g.sum(1), torch.ones(len(g)))  # softmax over the kept logits
    assert aux is not None and torch.isfinite(aux) and float(aux.detach()) > 0
    (loss + aux).backward()
    m = moe_layers(model)[0]
    assert m.router.grad is not None and m.router.grad.abs().sum() > 0
    assert MoE().aux_loss(model) is None  # collected once per forward


def test_moe_init_is_keyed_by_the_seed_and_top_k_above_experts_is_refused():
    a, b, c = model_of(), model_of(), model_of()
    spec = TuneSpec(peft="moe", experts=2, top_k=1, lora_rank=2)
    for model, seed in ((a, 5), (b, 5), (c, 6)):
        attach(model, spec, seed=seed)
    assert torch.equal(trainable_vector(a), trainable_vector(b))
    assert not torch.equal(trainable_vector(a), trainable_vector(c))
    with pytest.raises(FedheadError, match="'--top-k'"):
        attach(model_of(), TuneSpec(peft="moe", experts=2, top_k=3), seed=0)
    assert all(isinstance(m, MoELoRA) for m in moe_layers(a))


# ---------------------------------------------------------------- pfpt


def pfpt_model(tokens: int = 4, pool: int = 8):
    model = model_of()
    spec = TuneSpec(peft="pfpt", prompt_tokens=tokens, pfpt_pool=pool)
    tuning = attach(model, spec, seed=0)
    return model, tuning, spec


def client_vectors(model, prompt_sets, heads):
    """Client vectors in trainable_vector's layout with the given prompts [P, D] and classifier values."""
    out = []
    for prompts, head in zip(prompt_sets, heads):
        with torch.no_grad():
            model.encoder.vpt.tokens.copy_(prompts[None])
            model.classifier.weight.fill_(head)
            model.classifier.bias.fill_(head)
        out.append(trainable_vector(model))
    return torch.stack(out)


def prompts_of(model, vector):
    with torch.no_grad():
        i = 0
        for _, p in trainable(model):
            if p is model.encoder.vpt.tokens:
                return vector[i : i + p.numel()].view_as(p)[0]
            i += p.numel()


def test_pfpt_aggregation_of_identical_prompts_returns_them_and_averages_the_classifier_by_size():
    model, tuning, spec = pfpt_model()
    base = torch.randn(4, model.encoder.embed_dim, generator=torch.Generator().manual_seed(0))
    vec = client_vectors(model, [base, base, base], [1.0, 2.0, 4.0])
    new = tuning.aggregate(model, trainable_vector(model), vec, torch.tensor([10, 10, 20]), spec)
    assert new.shape == vec[0].shape and new.dtype == torch.float32
    assert torch.equal(prompts_of(model, new), base)
    assert len(tuning.pool) == 4 and torch.allclose(tuning.support, torch.ones(4, dtype=torch.float64))
    assert float(new[-1]) == pytest.approx((1.0 * 10 + 2.0 * 10 + 4.0 * 20) / 40)  # the classifier's bias


def test_pfpt_aligns_permuted_client_prompts_back_instead_of_averaging_slots():
    model, tuning, spec = pfpt_model(tokens=5, pool=10)
    g = torch.Generator().manual_seed(1)
    base = torch.randn(5, model.encoder.embed_dim, generator=g)
    sets = [base + 0.01 * torch.randn(base.shape, generator=g) for _ in range(3)]
    perms = [torch.arange(5), torch.tensor([3, 0, 4, 1, 2]), torch.tensor([4, 3, 2, 1, 0])]
    vec = client_vectors(model, [s[p] for s, p in zip(sets, perms)], [0.0, 0.0, 0.0])
    new = prompts_of(model, tuning.aggregate(model, trainable_vector(model), vec, torch.tensor([5, 7, 9]), spec))
    assert torch.allclose(new, sum(sets) / 3, atol=1e-5)  # each global prompt: the mean of its aligned copies
    assert len(tuning.pool) == 5
    # slot-wise averaging (FedAvg) would blur the prompts together: PFPT keeps them apart
    fedavg = sum(s[p] for s, p in zip(sets, perms)) / 3
    assert (fedavg - base).norm() > 10 * (new - base).norm()
    # the pool is invariant to the order of any client's prompts
    again = align_prompts(torch.stack([s[p] for s, p in zip(sets, reversed(perms))]).double())[0].float()
    assert torch.allclose(again[again[:, 0].argsort()], new[new[:, 0].argsort()], atol=1e-5)


def test_pfpt_opens_new_pool_prompts_for_unmatched_ones_and_keeps_the_pool_across_rounds():
    local = torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    centres, count, assign = align_prompts(local)
    assert len(centres) == 6 and count.tolist() == [1.0] * 6  # nothing in common: every prompt is its own
    assert sorted(i for a in assign for i in a) == list(range(6))
    tuning = PFPT()
    tuning.update_pool(local, size=4)
    assert len(tuning.pool) == 4
    state = tuning.state_dict()
    other = PFPT()
    other.load_state_dict(state)
    assert torch.equal(other.pool, tuning.pool) and torch.equal(other.support, tuning.support)
    other.update_pool(tuning.pool[None, :3] + 1e-4, size=4)  # a client that used three pool prompts
    assert len(other.pool) == 4 and other.support.tolist() == [1.0, 1.0, 1.0, 0.25]


def test_pfpt_refuses_a_cnn_in_one_line():
    with pytest.raises(FedheadError) as e:
        attach(model_of("test_efficientnet"), TuneSpec(peft="pfpt"), seed=0)
    msg = str(e.value)
    assert "\n" not in msg and "'--peft'" in msg and "'pfpt'" in msg and "CNN" in msg


# ---------------------------------------------------------------- one federated round each


@pytest.mark.parametrize("peft", ["moe", "pfpt"])
def test_one_round_of_each_baseline_runs_on_a_tiny_vit(tmp_path, peft):
    s = run_finetune(FinetuneConfig(**TINY, peft=peft, experts=2, top_k=1, lora_rank=2, prompt_tokens=3,
                                    pfpt_pool=6), tmp_path / peft)  # fmt: skip
    assert 0.0 <= s["final_accuracy"] <= 1.0 and s["trainable_parameters"] > 0
