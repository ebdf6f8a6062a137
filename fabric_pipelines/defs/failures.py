"""Why a Dagster run failed, in one line a user can act on: the step's own error out of Dagster's
wrapped chain, the asset checks that failed with their numbers. The CLI reads them from the
in-process result, the run-failure alerts from the instance's event log."""

from __future__ import annotations

from typing import Any

import dagster as dg


def failure_text(result: Any, what: str, task_set: str = "") -> str:
    """One line that says why the run failed and what to do: the failed step's own error (a
    dg.Failure's description, or the exception the asset raised), not Dagster's wrapper."""
    for event in result.all_events:
        if not event.is_step_failure or event.event_specific_data is None:
            continue
        error = getattr(event.event_specific_data, "error", None)
        if error is None:
            continue
        cause = user_error(error)
        if cause.cls_name == "DagsterAssetCheckFailedError":
            text = "; ".join(failed_checks(result)) or strip_class(cause)
        elif cause.cls_name in ("IntegrityError", "UniqueViolation"):
            text = (
                f"another run of task set {task_set!r} wrote the same rows at the same moment "
                f"({strip_class(cause).splitlines()[0]}); when it has finished, "
                f"`fabric run {task_set}` again picks up whatever is left"
            )
        else:
            text = strip_class(cause)
        return f"{what} failed in {event.step_key}: {text}"
    return f"{what} failed; see the run {result.run_id} in the Dagster UI"


def user_error(error: Any) -> Any:
    """The first error of Dagster's chain that is not Dagster's own wrapper around it."""
    while (
        error.cause is not None
        and error.cls_name.startswith("Dagster")
        and (error.cls_name != "DagsterAssetCheckFailedError")
    ):
        error = error.cause
    return error


def strip_class(error: Any) -> str:
    """An error's message without the `module.Class: ` its text starts with."""
    message = str(error.message).strip()
    head, sep, rest = message.partition(": ")
    if sep and head.rsplit(".", 1)[-1] == error.cls_name:
        return rest.strip()
    return message


def failed_checks(result: Any) -> list[str]:
    """Failed asset checks, each with the problems it recorded."""
    out = []
    for e in result.get_asset_check_evaluations():
        if e.passed:
            continue
        problems = e.metadata.get("problems") or e.metadata.get("what_to_change")
        detail = f": {problems.value}" if problems is not None else ""
        out.append(f"check {e.asset_key.to_user_string()}:{e.check_name} failed{detail}")
    return out


def failed_checks_in_run(instance: Any, run_id: str) -> list[str]:
    """Each asset check that failed in the run, with the numbers its metadata gives (a recall
    and its floor, what to change)."""
    records = instance.get_records_for_run(
        run_id, of_type=dg.DagsterEventType.ASSET_CHECK_EVALUATION
    ).records
    found = []
    for record in records:
        event = record.event_log_entry.dagster_event
        evaluation = event.event_specific_data if event is not None else None
        if evaluation is None or evaluation.passed:
            continue
        numbers = ", ".join(
            f"{name} {getattr(value, 'value', value)}"
            for name, value in evaluation.metadata.items()
        )
        found.append(
            f"check {evaluation.check_name} of {evaluation.asset_key.to_user_string()} failed"
            + (f" ({numbers})" if numbers else "")
        )
    return found


def innermost_error(error: Any) -> str:
    """The innermost error of Dagster's wrapped error chain: the user's own exception."""
    while error.cause is not None:
        error = error.cause
    return str(error.message).strip()
