"""`tandem serve` flags map onto ServerConfig (defaults kept where a flag is not given)."""
import argparse

from tandem.server.cli import add_serve_command, config_from_args
from tandem.server.runtime import ServerConfig


def parse(*argv):
    parser = argparse.ArgumentParser()
    add_serve_command(parser.add_subparsers())
    return config_from_args(parser.parse_args(["serve", *argv]))


def test_prefill_tokens_per_step_flag_and_default():
    assert parse("--model", "m").prefill_tokens_per_step == ServerConfig(model="m").prefill_tokens_per_step
    assert parse("--model", "m", "--prefill-tokens-per-step", "1024").prefill_tokens_per_step == 1024


def test_the_speculation_controller_is_the_default_and_fixed_k_turns_it_off():
    assert parse("--model", "m").adaptive_k is True and ServerConfig().adaptive_k is True
    assert parse("--model", "m", "--fixed-k").adaptive_k is False
