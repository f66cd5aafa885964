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


def agent_run(tmp_path, **start) -> "Path":
    """A stage's folder as the card reads it: its log and its before/after evaluations."""
    import json

    log = [{"event": "start", "steps": 4, "rope_theta": 1e5, "long": 4096, "chat_window": 1024,
            "lr": 5e-5, "chat_tokens": 1000, "init": "None", **start}]
    log += [{"event": "train", "step": i} for i in range(4)]
    (tmp_path / "train_log.jsonl").write_text("\n".join(json.dumps(e) for e in log))
    for name, theta, ppl, stop in (("before", 1e4, 30.0, 0), ("after", 1e5, 26.0, 25)):
        (tmp_path / f"eval_{name}.json").write_text(json.dumps({
            "rope_theta": theta, "context": 32768,
            "perplexity": {"heldout_tokens": 9000, "512": {"ppl": ppl}, "2048": {"ppl": 2 * ppl}},
            "chat": {"max_tokens": 64, "turns": 30, "stop": stop, "rows": [
                {"reply": "``python\n", "finish_reason": "stop", "tokens": 5},
                {"reply": "``python", "finish_reason": "stop", "tokens": 4},
                {"reply": "a def", "finish_reason": "stop", "tokens": 9},
                {"reply": "x" * 64, "finish_reason": "length", "tokens": 64}][:stop]}}))
    return tmp_path


def test_the_card_states_a_quantization_aware_stage_from_the_pack_and_its_short_windows(tmp_path):
    import model_card

    section = model_card.agent_section(agent_run(tmp_path, qat=True, short_every=2))
    assert "4 steps" in section and "all quantization-aware" in section
    assert "then 4 quantization-aware steps" not in section  # one phase, not two
    assert "every second corpus step is instead eight 512-token windows" in section
    assert "--steps 4 --qat --short-every 2 --rope-theta 100000" in section
    assert "| **this pack** | 26.00 | 52.00 |" in section and "**25/30**" in section
    assert "a median of 5 tokens, the most common reply (2 of 3) ``` ``python ```." in section
    plain = model_card.agent_section(agent_run(tmp_path, qat=False, short_every=0))
    assert "quantization-aware" not in plain and "512-token windows" not in plain
