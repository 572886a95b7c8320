"""OnlineEagle.publish writes the trained tensors into the served head in place; a shared LM head, frozen in both
copies, is neither written nor repacked."""
import torch

from tandem.drafters import build_drafter
from tandem.models import cpu_gemm
from tandem.models.eagle import EagleConfig, draft_vocab_from_tokens, new_eagle_head, save_eagle
from tandem.rl.eagle_online import OnlineEagle

from tiny_helpers import load_packed


def test_publish_installs_the_trained_tensors_and_leaves_the_shared_lm_head(tiny_llama, tmp_path):
    target = load_packed(tiny_llama)
    cfg = EagleConfig.for_target(target.cfg, 200, shared_lm_head=True)
    save_eagle(new_eagle_head(target, cfg, draft_vocab_from_tokens([], 200, target.cfg.vocab_size), torch.Generator().manual_seed(0)), tmp_path / "head")
    drafter = build_drafter("eagle", target=target, num_draft_tokens=4, max_batch=2, max_len=128, drafter_path=str(tmp_path / "head"))
    served = drafter.head
    rows = target.lm_head.weight.detach().float()[served.draft_to_target]
    lm_packed = (served.lm_head.int8, served.lm_head.packed, served.lm_head.compact)
    fc_packed = served.fc.int8
    pointers = {k: v.data_ptr() for k, v in served.state_dict().items()}
    online = OnlineEagle(drafter)
    assert not online.head.lm_head.weight.requires_grad and served.lm_head.is_packed and fc_packed is not None
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # what a training step does to the trainable copy
        for p in online.head.parameters():
            if p.requires_grad:
                p.add_(0.01 * torch.randn(p.shape, generator=gen))
    online.publish()
    assert drafter.version == 1
    trained = online.head.state_dict()
    for name, tensor in served.state_dict().items():
        assert torch.equal(tensor, trained[name]) and tensor.data_ptr() == pointers[name], name
    assert torch.equal(served.lm_head.weight, rows)
    assert all(a is b for a, b in zip((served.lm_head.int8, served.lm_head.packed, served.lm_head.compact), lm_packed))  # not repacked
    assert torch.equal(served.fc.int8[0], cpu_gemm.pack_q8(trained["fc.weight"])[0])  # a written Linear is repacked from its new weight
