"""A task set's prompt: text put before each of its texts before tokenising ("query: ",
"passage: "), chosen when the set is submitted and kept beside its inbox file, so that every
run of the set, from the CLI or from Dagster, tokenises it the same way.

A set submitted without one takes the model's default prompt (`default_prompt_name` in its
`config_sentence_transformers.json`), as sentence-transformers' encode() does; most models have
none.
"""

from __future__ import annotations

from pathlib import Path

from fabric_gpu.model import resolve_model_dir
from fabric_gpu.model_defaults import model_defaults
from fabric_pipelines.lib.core.files import write_bytes
from fabric_pipelines.lib.core.names import validate_task_set_name
from fabric_pipelines.lib.tasks.inbox import SUBMITTED


class PromptError(ValueError):
    """A prompt name the model does not define; the message lists the ones it does."""


def chosen_prompt(model_id: str, prompt: str | None, prompt_name: str | None) -> str | None:
    """The prompt asked for at submit: given as text, or by a name from the model's config;
    None when neither was asked (the model's default applies at ingest)."""
    if prompt is not None and prompt_name is not None:
        raise PromptError("give a prompt or a prompt name, not both")
    if prompt_name is None:
        if prompt:
            _check_pooling(model_id, prompt)
        return prompt
    named = model_defaults(resolve_model_dir(model_id)).prompts
    if prompt_name not in named:
        known = ", ".join(sorted(named)) or "none"
        raise PromptError(
            f"{model_id} defines no prompt named {prompt_name!r} (its prompts: {known}); pass "
            "the text with --prompt instead"
        )
    return _check_pooling(model_id, named[prompt_name])


def record_prompt(inbox: Path, task_set: str, prompt: str) -> None:
    write_bytes(_prompt_path(inbox, task_set), prompt.encode("utf-8"))


def set_prompt(inbox: Path, task_set: str, model_id: str) -> str:
    """The prompt `task_set` is tokenised with: the one recorded at submit, else the model's
    default prompt, else none ("")."""
    path = _prompt_path(inbox, task_set)
    if path.is_file():
        return _check_pooling(model_id, path.read_text(encoding="utf-8"))
    defaults = model_defaults(resolve_model_dir(model_id))
    if defaults.default_prompt_name:
        return _check_pooling(model_id, defaults.prompts.get(defaults.default_prompt_name, ""))
    return ""


def _check_pooling(model_id: str, prompt: str) -> str:
    """`prompt`, unless the model pools without its prompt's tokens (PromptError, saying what
    to do): the engines cannot, and would give other vectors than encode()."""
    problem = model_defaults(resolve_model_dir(model_id)).prompt_pooling_error(prompt, model_id)
    if problem:
        raise PromptError(problem)
    return prompt


def forget_prompt(inbox: Path, task_set: str) -> None:
    _prompt_path(inbox, task_set).unlink(missing_ok=True)


def _prompt_path(inbox: Path, task_set: str) -> Path:
    return inbox / SUBMITTED / f"{validate_task_set_name(task_set)}.prompt"
