"""The agent stage's step schedule (scripts/train_agent_stage.py): which windows a step
trains on, with and without the first stage's short windows in the mix."""

import numpy as np

import train_agent_stage as stage


def shapes(short_every: int, steps: int = 8) -> list:
    rng = np.random.default_rng(0)
    corpus, chat = np.arange(50_000) % 500, np.arange(20_000) % 300
    return [tuple(stage.batch_at(step, rng, corpus, chat, 4096, short_every).shape)
            for step in range(steps)]


def test_every_other_step_is_chat_and_the_rest_long_by_default():
    chat, long = (stage.CHAT_BATCH, stage.CHAT_WINDOW), (1, 4096)
    assert shapes(0) == [long, chat] * 4


def test_short_every_trains_every_nth_corpus_step_at_the_first_stages_length():
    chat, long = (stage.CHAT_BATCH, stage.CHAT_WINDOW), (1, 4096)
    short = (stage.SHORT_BATCH, stage.SHORT)
    assert shapes(2) == [long, chat, short, chat] * 2
    assert shapes(3, 12) == [long, chat, long, chat, short, chat] * 2
    assert stage.SHORT_BATCH * stage.SHORT == 4096  # a short step: a long step's tokens


class FixedTeacher:
    """A model whose next-token logits are given."""

    def __init__(self, logits):
        self.logits = logits

    def __call__(self, input_ids):
        return type("Out", (), {"logits": self.logits})()


def test_distillation_is_the_teachers_kl_to_the_student_per_token():
    import torch

    torch.manual_seed(0)
    x = torch.zeros(2, 5, dtype=torch.long)
    teacher, student = torch.randn(2, 5, 11), torch.randn(2, 5, 11)
    assert stage.distillation_loss(teacher, FixedTeacher(teacher), x).item() < 1e-6
    p, q = teacher.log_softmax(-1), student.log_softmax(-1)
    expected = (p.exp() * (p - q)).sum(-1).mean()
    found = stage.distillation_loss(student, FixedTeacher(teacher), x)
    assert torch.allclose(found, expected, atol=1e-6)
