"""The `mixquant` command, one module per group of commands: ``paths`` (paths, explain), ``plan``, ``run``
(run, pin-model, build-toy), ``verify``, ``inspect`` (inspect, predict, schema), on ``context`` (the config,
profile and artifact graph every command reads); ``parser`` holds the argument parser and the entry point."""

from mixquant.cli.parser import build_parser, main

__all__ = ["build_parser", "main"]
