"""TRL's GRPOTrainer as the peer of `tandem bench rl-trl`, run in TRL's own venv (imports nothing from tandem).

Reads the problems tandem exported (tandem/bench/peers/trl_peer.py: a meta line, the training problems in step order,
the held-out set), trains with GRPOTrainer on CPU (no vLLM, transformers generate) at the settings given on the
command line, one optimiser step per rollout batch of prompts_per_step x group_size completions, the dataset in
the exported order (shuffle_dataset=False), no KL (beta=0), fp32 without gradient checkpointing (TRL's defaults
are bf16 and checkpointing; tandem's learner does neither), the (tied) embedding frozen as tandem's learner freezes it. Reward: reasoning-gym's extract_answer + the task's own score_answer, on a dataset rebuilt from the
exported task settings and seed (as tandem's ReasoningEnv builds it). Writes one JSON: per step the wall time
(between the trainer's step ends), reward mean and completion length mean; the greedy held-out rewards per
problem before and after training; the versions; how many prompts tokenized exactly as tandem tokenized them.
"""
import argparse
import json
import sys
import tempfile
import time


def read_problems(path: str) -> tuple[dict, list[dict], list[dict]]:
    rows = [json.loads(line) for line in open(path) if line.strip()]
    if not rows or rows[0].get("kind") != "meta":
        raise SystemExit(f"{path}: the first line must be the meta record")
    return rows[0], [r for r in rows if r["kind"] == "train"], [r for r in rows if r["kind"] == "held_out"]


def scorers(meta: dict) -> dict:
    """One reasoning-gym dataset per task, built as tandem's ReasoningEnv builds its training split."""
    import reasoning_gym

    out = {}
    for task in meta["env"]["tasks"]:
        kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in meta["env"]["task_kwargs"].get(task, {}).items()}
        out[task] = reasoning_gym.create_dataset(task, seed=meta["train_seed_base"], size=meta["size"], **kwargs)
    return out


def make_reward(datasets_by_task: dict):
    from reasoning_gym.utils import extract_answer

    def reasoning_gym_reward(prompts, completions, task, entry, **kwargs):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [float(datasets_by_task[t].score_answer(extract_answer(x), json.loads(e))) for x, t, e in zip(texts, task, entry)]

    return reasoning_gym_reward


def greedy_eval(model, tokenizer, problems: list[dict], score, max_tokens: int, batch: int = 16) -> dict:
    """Greedy completions of the held-out problems (left-padded batches), scored per problem."""
    import torch

    eos = sorted({tokenizer.eos_token_id} | set(_as_list(model.generation_config.eos_token_id)))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    rewards, lengths = [], []
    model.eval()
    for i in range(0, len(problems), batch):
        part = problems[i : i + batch]
        ids = [p["ids"] for p in part]
        width = max(map(len, ids))
        x = torch.tensor([[pad] * (width - len(r)) + r for r in ids])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in ids])
        with torch.inference_mode():
            out = model.generate(input_ids=x, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False, eos_token_id=eos, pad_token_id=pad)
        for p, row in zip(part, out[:, width:].tolist()):
            cut = next((j + 1 for j, t in enumerate(row) if t in eos), len(row))
            lengths.append(cut)
            text = tokenizer.decode(row[:cut], skip_special_tokens=True)
            rewards.append(score(p, text))
    return {"rewards": rewards, "tokens_mean": sum(lengths) / max(1, len(lengths))}


def _as_list(x) -> list:
    return [] if x is None else list(x) if isinstance(x, (list, tuple)) else [x]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True, help="an HF-format model directory")
    p.add_argument("--problems", required=True, help="the JSONL tandem exported")
    p.add_argument("--out", required=True)
    p.add_argument("--group-size", type=int, required=True)
    p.add_argument("--max-tokens", type=int, required=True)
    p.add_argument("--temperature", type=float, required=True)
    p.add_argument("--lr", type=float, required=True)
    p.add_argument("--loss-type", required=True)
    p.add_argument("--scale-rewards", required=True)
    p.add_argument("--epsilon", type=float, required=True)
    p.add_argument("--epsilon-high", type=float, required=True)
    p.add_argument("--micro-batch", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--train-embeddings", action="store_true", help="train the (tied) embedding too (tandem freezes it by default)")
    a = p.parse_args()

    import torch

    torch.set_num_threads(a.threads)
    import datasets
    from reasoning_gym.utils import extract_answer
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    meta, train, held = read_problems(a.problems)
    steps, per_step = meta["steps"], meta["prompts_per_step"]
    if len(train) != steps * per_step:
        raise SystemExit(f"expected {steps * per_step} training problems, found {len(train)}")
    by_task = scorers(meta)
    tokenizer = AutoTokenizer.from_pretrained(a.model)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    if not a.train_embeddings:
        model.get_input_embeddings().weight.requires_grad_(False)

    def render(messages) -> list[int]:
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])

    rows = train + held
    matches = sum(render(r["messages"]) == r["prompt_ids"] for r in rows if "prompt_ids" in r)
    for r in held:
        r["ids"] = render(r["messages"])

    def score(problem: dict, text: str) -> float:
        return float(by_task[problem["task"]].score_answer(extract_answer(text), problem["entry"]))

    from importlib.metadata import version  # the installed distributions (reasoning_gym.__version__ lags its releases)

    versions = {name: version(name) for name in ("trl", "transformers", "accelerate", "datasets", "torch", "reasoning-gym")}
    versions["python"] = sys.version.split()[0]
    t0 = time.perf_counter()
    start = greedy_eval(model, tokenizer, held, score, a.max_tokens)
    start["eval_s"] = time.perf_counter() - t0

    dataset = datasets.Dataset.from_list([{"prompt": r["messages"], "task": r["task"], "entry": json.dumps(r["entry"])} for r in train])
    n = per_step * a.group_size
    out_dir = tempfile.mkdtemp(prefix="trl-grpo-")
    cfg = GRPOConfig(
        output_dir=out_dir, per_device_train_batch_size=a.micro_batch, gradient_accumulation_steps=n // a.micro_batch,
        num_generations=a.group_size, max_completion_length=a.max_tokens, temperature=a.temperature, top_p=1.0, top_k=0,
        learning_rate=a.lr, lr_scheduler_type="constant", warmup_steps=0, adam_beta1=0.9, adam_beta2=0.99, weight_decay=0.0,
        max_grad_norm=1.0, beta=0.0, epsilon=a.epsilon, epsilon_high=a.epsilon_high, loss_type=a.loss_type, scale_rewards=a.scale_rewards,
        num_iterations=1, max_steps=steps, shuffle_dataset=False, logging_steps=1, report_to="none", save_strategy="no", use_cpu=True,
        bf16=False, fp16=False, gradient_checkpointing=False, seed=a.seed, disable_dropout=True, dataloader_num_workers=0, remove_unused_columns=False, use_vllm=False,
    )
    records: list[dict] = []

    class StepTimer(TrainerCallback):
        """Wall time between step ends (the first from train begin): generation, reward, loss, backward, optimiser."""

        def on_train_begin(self, args, state, control, **kwargs):
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            records.append({"step": state.global_step - 1, "wall_s": now - self.t})
            self.t = now

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs and records and "reward_mean" not in records[-1]:
                records[-1] |= {"reward_mean": logs["reward"], "completion_tokens_mean": logs.get("completions/mean_length")}

    trainer = GRPOTrainer(model=model, reward_funcs=make_reward(by_task), args=cfg, train_dataset=dataset, processing_class=tokenizer,
                          callbacks=[StepTimer()])
    t1 = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t1
    t2 = time.perf_counter()
    end = greedy_eval(trainer.model, tokenizer, held, score, a.max_tokens)
    end["eval_s"] = time.perf_counter() - t2
    settings = {k: getattr(cfg, k) for k in ("per_device_train_batch_size", "gradient_accumulation_steps", "generation_batch_size", "steps_per_generation",
                                              "num_generations", "max_completion_length", "temperature", "learning_rate", "loss_type", "scale_rewards",
                                              "beta", "epsilon", "epsilon_high", "num_iterations", "max_steps", "shuffle_dataset", "seed",
                                              "gradient_checkpointing", "bf16", "max_grad_norm", "adam_beta2", "weight_decay", "lr_scheduler_type")}
    settings["trainable_parameters"] = sum(q.numel() for q in model.parameters() if q.requires_grad)
    result = {"versions": versions, "settings": settings, "steps": records, "train_s": train_s, "held_out_start": start, "held_out_end": end,
              "prompt_ids_match": [matches, sum("prompt_ids" in r for r in rows)], "threads": torch.get_num_threads()}
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
