"""Chapter 15: the live server against its own OpenAPI schema. Schemathesis reads
/openapi.json from a running `python -m minisgl`, generates requests for every operation the
schema names (its coverage and fuzzing phases; stateful when the schema has links), sends them
over loopback, and checks each answer: no 5xx, a status code the schema documents, a body that
conforms to the documented schema. The run is bounded (examples per operation, a timeout per
request, and a wall-clock deadline that stops the run, a budget on a slow machine rather than a
failure) and deterministic (fixed seed, derandomized); `pytest -s` shows what it sent and every
failure with the request that caused it."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import schemathesis
from schemathesis.engine import events, from_schema

from serving import Server

MAX_EXAMPLES = 300  # per operation in the fuzzing phase; the coverage phase sends its own set
DEADLINE_S = 150  # the whole run: past it the engine stops; what was sent is still judged
REQUEST_TIMEOUT_S = 30
SMALL_MAX_TOKENS = 4  # given to a generated generation request that names no limit
GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions", "/generate")
SCHEMA_CHECKS = ("response_schema_conformance", "status_code_conformance")
CHECKS = ("not_a_server_error", *SCHEMA_CHECKS)


def config(stateful: bool, max_examples: int) -> Any:
    return schemathesis.Config.from_dict({
        "seed": 15,
        "cache": {"enabled": False},  # no .schemathesis/ folder left behind
        "continue-on-failure": True,  # every failing case is reported, not one per operation
        "request-timeout": REQUEST_TIMEOUT_S,
        "generation": {"max-examples": max_examples, "deterministic": True},
        "phases": {"stateful": {"enabled": stateful}},
        "checks": {"enabled": False, **{name: {"enabled": True} for name in CHECKS}},
    })


def short(text: str | bytes | None, n: int = 300) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    text = text or ""
    return text if len(text) <= n else f"{text[:n]}... ({len(text)} chars)"


@dataclass
class Run:
    """What one run sent (every request, by operation and status) and what failed."""

    statuses: Counter[tuple[str, int]] = field(default_factory=Counter)
    server_errors: list[str] = field(default_factory=list)  # every 5xx, with its request
    failures: dict[str, list[str]] = field(default_factory=lambda: {n: [] for n in CHECKS})
    problems: list[str] = field(default_factory=list)  # engine errors: the test fails on them
    deadline_hit: bool = False
    seen: set[tuple[str, str]] = field(default_factory=set)
    phase_s: Counter[str] = field(default_factory=Counter)
    stop_reason: str = "?"
    seconds: float = 0.0

    @property
    def sent(self) -> int:
        return sum(self.statuses.values())

    @property
    def five(self) -> int:
        return sum(n for (_, status), n in self.statuses.items() if status >= 500)

    @property
    def violations(self) -> int:
        return sum(len(self.failures[name]) for name in SCHEMA_CHECKS)

    def record(self, event: events.EngineEvent) -> None:
        if isinstance(event, events.ScenarioFinished):
            self.phase_s[str(event.phase)] += event.elapsed_time
            rec = event.recorder
            for case_id, nodes in rec.checks.items():
                for node in nodes:
                    if node.failure_info is None:
                        continue
                    failure = node.failure_info.failure
                    found = describe(failure, rec.interactions.get(failure.case_id or case_id))
                    if (node.name, found) not in self.seen:  # the same request in two phases
                        self.seen.add((node.name, found))
                        self.failures.setdefault(node.name, []).append(f"[{event.phase}] {found}")
        elif isinstance(event, events.NonFatalError):
            self.problems.append(f"error in {event.label}: {short(str(event.value))}")
        elif isinstance(event, events.FatalError):
            self.problems.append(f"fatal: {short(str(event.exception))}")
        elif isinstance(event, events.EngineFinished):
            self.stop_reason = str(event.stop_reason)

    def report(self) -> None:
        stop = "stopped at the deadline" if self.deadline_hit else self.stop_reason
        print(f"\nschemathesis: {self.sent} requests in {self.seconds:.1f} s ({stop};"
              f" {', '.join(f'{p} {s:.1f} s' for p, s in self.phase_s.items())}); "
              f"5xx: {self.five}; schema violations: {self.violations} ("
              f"{', '.join(f'{n} {len(self.failures[n])}' for n in SCHEMA_CHECKS)})")
        for (label, status), n in sorted(self.statuses.items()):
            print(f"  {label}: {status} x{n}")
        for line in self.server_errors:
            print(f"  5xx: {line}")
        for name, lines in self.failures.items():
            for line in lines:
                print(f"  {name}: {line}")
        for line in self.problems:
            print(f"  {line}")


def describe(failure: Any, interaction: Any) -> str:
    if interaction is None:
        return f"{failure.title}: {short(failure.message)} (no request recorded)"
    request, response = interaction.request, interaction.response
    answer = (f"{response.status_code} {short(response.content)}" if response is not None
              else "no response")
    message = short(" | ".join(line.strip() for line in failure.message.splitlines()
                               if line.strip()))
    return (f"{failure.title}: {message}\n"
            f"      request: {request.method} {request.uri} body={short(request.body)!r}\n"
            f"      response: {answer}")


def run(server: Server, stateful: bool = True, max_examples: int = MAX_EXAMPLES,
        deadline_s: float = DEADLINE_S) -> Run:
    """One schemathesis run of every operation against the live server."""
    schema = schemathesis.openapi.from_url(f"http://127.0.0.1:{server.port}/openapi.json",
                                           config=config(stateful, max_examples),
                                           timeout=REQUEST_TIMEOUT_S)
    result, start = Run(), time.monotonic()
    stream = from_schema(schema).execute()

    def before_call(ctx: Any, case: Any, kwargs: dict[str, Any]) -> None:
        """A generation request whose generated body names no limit gets a small one, so that
        it does not run to the end of the context; a limit it names (even a huge one) is sent
        as generated: the server must clip or refuse it."""
        body = case.body
        if (case.path in GENERATION_PATHS and isinstance(body, dict)
                and "max_tokens" not in body and "max_completion_tokens" not in body):
            body["max_tokens"] = SMALL_MAX_TOKENS

    @schema.hook
    def after_call(ctx: Any, case: Any, response: Any) -> None:
        result.statuses[(case.operation.label, response.status_code)] += 1
        if response.status_code >= 500:
            result.server_errors.append(
                f"{case.method} {case.formatted_path} body={short(response.request.body)!r} -> "
                f"{response.status_code} {short(response.content)}")
        if time.monotonic() - start > deadline_s and not result.deadline_hit:
            result.deadline_hit = True
            stream.stop()

    schemathesis.hook(before_call)  # before_call has no per-schema form: global, then removed
    try:
        for event in stream:
            result.record(event)
    finally:
        schemathesis.hooks.unregister(before_call)
    result.seconds = time.monotonic() - start
    return result


def test_every_operation_conforms_to_its_schema(server: Server) -> None:
    result = run(server)
    result.report()
    assert result.sent > 0 and not result.problems, result.problems
    assert result.five == 0 and not result.failures["not_a_server_error"], "\n".join(
        result.server_errors + result.failures["not_a_server_error"])
    assert result.violations == 0, "\n".join(
        line for name in SCHEMA_CHECKS for line in result.failures[name])
