"""The console logger of every job: Dagster's own format, with one switch. A run started by the
`fabric` command sets `tracebacks: false`, so a failed step prints its one-line summary, not
Dagster's stack trace: the command prints the reason and what to do once the run ends
(defs/failures.py). Runs from the UI keep the whole trace, and the event log always holds it."""

import logging

import coloredlogs  # type: ignore[import-untyped]  # Dagster's own dependency, untyped
import dagster as dg

# Dagster's console format (dagster._utils.log), so the lines read as before.
FORMAT = "%(asctime)s - %(name)s - %(levelname)s - %(message)s"
DATE_FORMAT = "%Y-%m-%d %H:%M:%S %z"


class _FirstParagraph(logging.Filter):
    """A message that carries a stack trace keeps its first paragraph: the event's summary."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "Stack Trace:" in message:
            record.msg, record.args = message.split("\n\n", 1)[0], None
        return True


@dg.logger(
    {
        "log_level": dg.Field(str, is_required=False, default_value="INFO"),
        "name": dg.Field(str, is_required=False, default_value="dagster"),
        "tracebacks": dg.Field(
            bool,
            is_required=False,
            default_value=True,
            description="Print failures' stack traces (the event log keeps them either way).",
        ),
    },
    description="Dagster's colored console logger; `tracebacks: false` leaves out stack traces.",
)
def console(init_context: dg.InitLoggerContext) -> logging.Logger:
    config = init_context.logger_config
    level = logging.getLevelName(str(config["log_level"]).upper())
    logger = logging.Logger(config["name"], level=level)
    coloredlogs.install(
        logger=logger, level=level, fmt=FORMAT, datefmt=DATE_FORMAT,
        field_styles={"levelname": {"color": "blue"}, "asctime": {"color": "green"}},
        level_styles={"debug": {}, "error": {"color": "red"}},
    )  # fmt: skip
    if not config["tracebacks"]:
        logger.addFilter(_FirstParagraph())
    return logger


@dg.definitions
def loggers() -> dg.Definitions:
    return dg.Definitions(loggers={"console": console})
