"""The admin API's version files hold a head's trainable tensors only; a file written before versions left the
shared LM head out is adopted without it."""
import torch
from safetensors import safe_open

from tandem.drafters import build_drafter
from tandem.flywheel.weights import HotSwapper, WeightStore, WeightVersion, checksum, save_version
from tandem.models.eagle import EagleConfig, draft_vocab_from_tokens, new_eagle_head, save_eagle
from tandem.server.admin import DrafterControl

from tiny_helpers import load_packed

TRAINABLE = {"attn.o.weight", "attn.qkv.weight", "draft_to_target", "fc.weight", "hidden_norm.weight", "input_norm.weight",
             "mlp.down.weight", "mlp.gate_up.weight", "mlp_norm.weight", "norm.weight"}


def keys(path) -> set[str]:
    with safe_open(str(path), framework="pt") as f:
        return set(f.keys())


def test_version_files_hold_the_trainable_tensors_and_an_old_file_is_adopted_without_the_lm_head(tiny_llama, tmp_path):
    target = load_packed(tiny_llama)
    cfg = EagleConfig.for_target(target.cfg, 200, shared_lm_head=True)
    save_eagle(new_eagle_head(target, cfg, draft_vocab_from_tokens([], 200, target.cfg.vocab_size), torch.Generator().manual_seed(0)), tmp_path / "head")
    drafter = build_drafter("eagle", target=target, num_draft_tokens=4, max_batch=2, max_len=128, drafter_path=str(tmp_path / "head"))
    head = drafter.head
    rows = target.lm_head.weight.detach().float()[head.draft_to_target]
    store = WeightStore(first_version=1)
    swapper = HotSwapper(drafter, store, background=False)
    versions = tmp_path / "versions"
    control = DrafterControl(drafter, store, swapper, versions)
    try:
        assert keys(versions / "drafter-v000000.safetensors") == TRAINABLE  # the served version, written at start
        full = {k: v + 0.01 if v.is_floating_point() else v.clone() for k, v in head.state_dict().items()}
        save_version(WeightVersion(7, full, checksum(full), {}), versions)  # as the code before wrote every version
        assert control.adopt(7) == {"requested": 7, "published_as": 1}
        swapper()
        assert swapper.stats.refused == 0 and swapper.stats.swaps == 1 and drafter.version == 1
        assert torch.equal(head.fc.weight, full["fc.weight"]) and torch.equal(head.lm_head.weight, rows)
        assert keys(versions / "drafter-v000001.safetensors") == TRAINABLE
    finally:
        control.close()
