"""What a trainer step reads of the memory it keeps (tandem.flywheel.step_bytes), measured on the tiny model."""
import pytest
import torch

from tandem.flywheel.buffer import TraceBuffer
from tandem.flywheel.step_bytes import step_reads
from tandem.flywheel.trainer import FlywheelConfig, OnlineTrainer, target_lm_rows, trainer_copy
from tandem.flywheel.weights import WeightStore
from tandem.models.eagle import EagleConfig, draft_vocab_from_tokens, new_eagle_head

from flywheel_helpers import eagle_engine, served_traces

DRAFT_VOCAB = 200


@pytest.fixture(scope="module")
def trainer(target):
    """A recipe-style head (its LM head the target's frozen rows) over 4 live traces (branch nodes included), after
    one warm-up step (the optimiser's moments exist from then on)."""
    cfg = EagleConfig.for_target(target.cfg, DRAFT_VOCAB, shared_lm_head=True)
    head = new_eagle_head(target, cfg, draft_vocab_from_tokens([], DRAFT_VOCAB, target.cfg.vocab_size), torch.Generator().manual_seed(0))
    buffer = TraceBuffer()
    for trace in served_traces(target, n=4, seed=3, engine=eagle_engine(target, batch=2)):
        buffer.put(trace)
    trainer = OnlineTrainer(trainer_copy(head), target_lm_rows(target, head), buffer, WeightStore(), FlywheelConfig(batch_size=4, warmup=1, publish_every=100))
    trainer.train_step()
    return trainer


def test_a_step_reads_the_target_rows_once_and_the_frozen_lm_head_twice(trainer, target):
    """The target's rows of the draft vocabulary [Vd, d] fp32 are read once a step for every trace and loss term
    (imitation and branch; before: once per trace and term, 8x on this batch), the frozen LM head once forward and
    once backward (no weight gradient). The whole step's reads are pinned for this model and these traces."""
    rows = DRAFT_VOCAB * target.cfg.hidden_size * 4
    read = step_reads(trainer)
    assert read["target_rows"] == rows and read["lm_head"] == 2 * rows
    assert read == {"target_rows": rows, "lm_head": 2 * rows, **PINNED}


# the rest of this step's reads on the tiny model (d = 64): the layer's weights once per unroll step and once for the
# branch nodes, forward and backward, for the 4 traces packed together (tandem.flywheel.packing; trace by trace they
# were read once per trace and unroll step: 7,871,968 bytes), the embedding rows it looks up (the packing's padding
# entries look up id 0: 72,192 bytes before), AdamW's moments
PINNED = {"layer": 2_142_976, "embedding": 75_264, "optimizer": 1_152_000}
