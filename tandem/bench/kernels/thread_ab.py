"""`OMP_WAIT_POLICY={ACTIVE|PASSIVE} python -m tandem.bench.kernels.thread_ab --batch B`: one engine's decode step timed from the
main thread and from another thread, alternated (docs/BENCHMARKS.md 12). With 2 threads on a 2-vCPU box: beside other
work, spinning workers made a step from the main thread 2-33x slower than PASSIVE; on a quiet box libgomp's default (spin
~300k iterations, then sleep; `OMP_WAIT_POLICY=` with an empty value keeps it) made it 1.55-1.8x faster. The policy is read
when torch loads OpenMP, so it comes from the environment; `import tandem` chooses one only where none is set
(`tandem.wait_policy`).
"""
from __future__ import annotations

import argparse
import json
import os
import threading
import time

from tandem.config import SamplingParams
from tandem.data.prompts import load_prompts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    from tandem.llm import LLM

    llm = LLM(args.model, max_batch_size=args.batch, max_model_len=1024, num_threads=args.threads)
    engine = llm.engine
    params = SamplingParams(max_tokens=args.steps * args.rounds * 2 + 2, temperature=0.0, ignore_eos=True)
    for prompt in [p.prompt for p in load_prompts("builtin", per_domain=12, split="test")][:args.batch]:
        engine.add_request(llm.apply_chat_template([{"role": "user", "content": prompt}]), params)
    engine.step()  # the prefill
    out: dict[str, list[float]] = {"main": [], "other": []}

    def timed(where: str) -> None:
        start = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        out[where].append(round(1e3 * (time.perf_counter() - start) / args.steps, 1))

    for _ in range(args.rounds):
        timed("main")
        worker = threading.Thread(target=timed, args=("other",))
        worker.start()
        worker.join()
    print(json.dumps({"policy": os.environ.get("OMP_WAIT_POLICY"), "batch": args.batch, "ms_per_step": out, "load": os.getloadavg()[0]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
