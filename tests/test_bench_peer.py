"""bench peer's weight copy: our dense model and Hugging Face's MixtralForCausalLM holding its weights
give the same logits and the same greedy tokens (timing is not asserted; transformers is optional)."""

import pytest
import torch
from helpers import small_config

from moekv_ref.apps import bench_peer


@pytest.fixture(scope="module")
def pair():
    pytest.importorskip("transformers")
    config = small_config("dense", num_local_experts=4, num_experts_per_tok=2)
    model = bench_peer.random_dense_model(seed=1, config=config)
    return model, bench_peer.copy_into_mixtral(model)


def test_weight_copy_gives_the_same_logits(pair):
    model, hf = pair
    tokens = torch.randint(0, model.config.vocab_size, (3, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours, theirs = model(tokens).logits, hf(tokens).logits
    assert (ours - theirs).abs().max() < 1e-4


def test_every_path_gives_hf_s_greedy_tokens(pair):
    model, hf = pair
    prompts = bench_peer.bench_prompts(3, 6, model.config.vocab_size, seed=3)
    reference = bench_peer.run_path("hf", model, hf, prompts, max_new_tokens=8)
    assert all(len(t) == 8 for t in reference)
    for path in ("paged", "contiguous", "engine"):
        assert bench_peer.run_path(path, model, hf, prompts, max_new_tokens=8) == reference, path


def test_the_copy_refuses_an_expert_model():
    model = bench_peer.random_dense_model(seed=0, config=small_config("expert"))
    with pytest.raises(ValueError, match="dense"):
        bench_peer.copy_into_mixtral(model)


def test_rotate_half_order_puts_even_channels_first():
    assert bench_peer.rotate_half_order(2, 4).tolist() == [0, 2, 1, 3, 4, 6, 5, 7]


def test_without_transformers_it_says_so_and_exits_2(monkeypatch, capsys):
    import sys

    from moekv_ref.apps import cli

    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers raises ImportError
    assert cli.main(["bench", "peer"]) == 2
    assert "transformers" in capsys.readouterr().out
