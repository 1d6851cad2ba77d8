"""Scoring code by running it: one sandbox per sample (the ``python`` tool's), many samples in parallel.

``CodeScorer`` takes the program from a response (``code_tests.extract_program``), sends it with the
sample's tests to a fresh sandbox (``hybridflow.tools.run_python``), where ``code_harness`` runs every test in
a child process of its own with the per-test limits, and judges what came back. A sample scores 1 when every
test passed (``reward_model.code.score=all_or_nothing``, the default) or the share of tests passed
(``fraction``). Whatever the program does (a wrong answer, a crash, an endless loop, a fork bomb, writing
everywhere, killing its tester) it only fails its own tests: the sandbox's limits hold, and a report that
did not come back whole scores 0.

Why threads for the parallelism: every sample's work runs in its sandbox's processes, so the threads only
wait; ``max_concurrent`` (default: 4 per CPU core) bounds the sandboxes running at once.

Per-sample results (the reward manager logs each numeric one as ``reward_extra/<key>/mean``): ``score``,
``acc`` (every test passed), ``pass_rate`` (share of tests passed), ``syntax_error``, ``timeout`` (a test or
the sample ran out of time), ``sandbox_s`` (the sandbox's wall time).

Which problems fail at the start instead of mid-run: a malformed test (``check_ground_truths`` reads every
code row when the trainer starts) and a machine with no sandbox (``SandboxUnavailable``).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from hybridflow.config.schema import CodeRewardConfig
from hybridflow.rewards.code_harness import RESULT_MARKER
from hybridflow.rewards.code_tests import (
    CodeTests,
    extract_program,
    output_cap,
    output_matches,
    parse_tests,
    value_matches,
)
from hybridflow.tools import SandboxLimits, SandboxResult, run_python
from hybridflow.tools.sandbox import sandbox_mode

#: data_source values scored by running the code: ours, HumanEval's and MBPP's names, and verl's code sources
CODE_SOURCES = (
    "code",
    "humaneval",
    "openai/openai_humaneval",
    "mbpp",
    "codecontests",
    "apps",
    "codeforces",
    "taco",
    "livecodebench",
)
HARNESS = Path(__file__).with_name("code_harness.py").read_text()
REPORT_BYTES = 4096  # the report's own JSON around the tests' captured output


class CodeScorer:
    """Scores responses against code tests. ``allow_unsafe``: run without isolation where this machine
    has no sandbox (the python tool's opt-out key)."""

    def __init__(self, config: CodeRewardConfig | None = None, allow_unsafe: bool = False) -> None:
        self.config = config or CodeRewardConfig()
        self.allow_unsafe = allow_unsafe

    @property
    def max_concurrent(self) -> int:
        """``reward_model.code.max_concurrent``, else 4 per CPU core: a sandbox's wall time is mostly waiting
        (two interpreters starting, namespaces built and torn down), so more sandboxes than cores keep them
        busy (bench/code_reward.py: 8 at once on 2 cores scored a sample in about half the time 2 did)."""
        code = self.config
        return code.max_concurrent or 4 * (os.cpu_count() or 1)

    def check_ground_truths(self, rows: Iterable[tuple[str, Any]]) -> int:
        """Parse every ``(where, ground_truth)`` (``InputError`` naming the first malformed one) and make
        sure this machine has a sandbox (``SandboxUnavailable``, one line saying how to get one); returns
        the number of rows read. Called when a run starts, so neither problem shows up as silent zeros."""
        count = 0
        for where, truth in rows:
            parse_tests(truth, where)
            count += 1
        if count:
            sandbox_mode(self.allow_unsafe)
        return count

    def limits(self, tests: CodeTests) -> SandboxLimits:
        """The sample's sandbox: its wall clock, CPU seconds and memory, and an output cap that holds every
        test's captured output."""
        c = self.config
        caps = sum(output_cap(e) for e in tests.expected) + len(tests) * 400
        return SandboxLimits(
            timeout_s=c.sample_timeout_s + 1.0,  # the harness stops in time; this catches one that does not
            cpu_s=math.ceil(c.sample_timeout_s) + 1,
            memory_mb=c.memory_limit_mb,
            max_output_bytes=caps + REPORT_BYTES,
        )

    def program_spec(self, program: str, tests: CodeTests) -> dict[str, Any]:
        c = self.config
        return {
            "program": program,
            "kind": tests.kind,
            "setup": tests.setup,
            "tests": tests.sandbox,
            "output_caps": [output_cap(e) for e in tests.expected],
            "test_timeout_s": c.test_timeout_s,
            "test_cpu_s": math.ceil(c.test_timeout_s),
            "budget_s": c.sample_timeout_s,
        }

    def sandbox_code(self, program: str, tests: CodeTests) -> str:
        """What the sandbox runs: the harness, then its call on the spec (JSON in a string literal)."""
        return f"{HARNESS}\nmain(json.loads({json.dumps(self.program_spec(program, tests))!r}))\n"

    def score(
        self, response: str, ground_truth: Any, extra_info: dict[str, Any] | None = None
    ) -> dict[str, float]:
        """One sample's result dict (see the module docstring)."""
        tests = parse_tests(ground_truth)
        code = self.sandbox_code(extract_program(response, tests), tests)
        return self.judge(run_python(code, self.limits(tests), self.allow_unsafe), tests)

    def judge(self, result: SandboxResult, tests: CodeTests) -> dict[str, float]:
        """The verdicts from what the sandbox reported: only a complete report of the harness counts."""
        report = _report(result.stdout)
        outcome = {"syntax_error": 0.0, "timeout": 0.0, "sandbox_s": result.duration_s}
        if report is None or len(report.get("tests", [])) != len(tests):
            syntax = report is not None and "syntax_error" in report
            timed_out = result.error is not None and "timed out" in result.error
            return {
                **self._scores(0, len(tests)),
                **outcome,
                "syntax_error": float(syntax),
                "timeout": float(timed_out),
            }
        passed = sum(_passed(entry, tests, i) for i, entry in enumerate(report["tests"]))
        outcome["timeout"] = float(any(entry.get("status") == "timeout" for entry in report["tests"]))
        return {**self._scores(passed, len(tests)), **outcome}

    def _scores(self, passed: int, total: int) -> dict[str, float]:
        rate = passed / total
        score = rate if self.config.score == "fraction" else float(passed == total)
        return {"score": score, "acc": float(passed == total), "pass_rate": rate}

    def score_many(self, items: Sequence[tuple[str, Any, Any]]) -> list[dict[str, float]]:
        """``(response, ground_truth, extra_info)`` triples scored ``max_concurrent`` at a time, in order."""
        if len(items) <= 1 or self.max_concurrent == 1:
            return [self.score(*item) for item in items]
        with ThreadPoolExecutor(
            min(self.max_concurrent, len(items)), thread_name_prefix="code-reward"
        ) as pool:
            return list(pool.map(lambda item: self.score(*item), items))

    def __call__(
        self, data_source: str, solution_str: str, ground_truth: Any, extra_info: dict[str, Any] | None = None
    ) -> dict[str, float]:
        """``compute_score``'s signature, for ``custom_reward_function`` files that delegate code rows here."""
        return self.score(solution_str, ground_truth, extra_info)


def _report(stdout: str) -> dict[str, Any] | None:
    """The harness's one result line; None when it is missing, repeated or not the JSON it writes."""
    lines = [line for line in stdout.splitlines() if line.startswith(RESULT_MARKER)]
    if len(lines) != 1:
        return None
    try:
        report = json.loads(lines[0][len(RESULT_MARKER) :])
    except json.JSONDecodeError:
        return None
    return report if isinstance(report, dict) else None


def _passed(entry: Any, tests: CodeTests, index: int) -> bool:
    if not isinstance(entry, dict) or entry.get("status") != "done":
        return False
    if tests.kind == "stdio":
        return isinstance(entry.get("stdout"), str) and output_matches(entry["stdout"], tests.expected[index])
    if tests.kind == "call":
        return isinstance(entry.get("value"), str) and value_matches(entry["value"], tests.expected[index])
    return True


def compute_score(
    solution_str: str, ground_truth: Any, extra_info: dict[str, Any] | None = None
) -> dict[str, float]:
    """The rule-scorer form (``RULE_SCORERS``): the default limits, one sample."""
    return CodeScorer().score(solution_str, ground_truth, extra_info)
