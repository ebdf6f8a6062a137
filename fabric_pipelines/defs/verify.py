"""verify_job: `fabric verify` over every task set, index and receipt, as a Dagster run.

Findings fail the run (a dg.Failure listing each problem and its repair command), so the
run-failure sensor writes them to the alerts file like any other failed run, and the UI shows
the failed run with the same text.
"""

import dagster as dg

from fabric_pipelines.defs.resources import ArtifactStore, Database
from fabric_pipelines.lib.maintenance.verify import verify

MAX_LISTED = 50  # findings spelled out in the failure; the rest are counted


@dg.op(
    description=(
        "Hashes every stored file (task sets, plans, hidden-state shards, index files, "
        "receipts) against the database and receipts, and checks the accounting."
    )
)
def verify_everything(
    context: dg.OpExecutionContext, store: ArtifactStore, database: Database
) -> dg.Output[int]:
    report = verify(database.engine(), store.paths())
    for note in report.notes:
        context.log.info(note)
    checked = {k: dg.MetadataValue.int(v) for k, v in report.checked.items()}
    if not report.clean:
        listed = [
            f"{f.kind} {f.subject}: {f.problem} -> repair: {f.repair}"
            for f in report.findings[:MAX_LISTED]
        ]
        more = len(report.findings) - len(listed)
        raise dg.Failure(
            description=(
                f"fabric verify: {len(report.findings)} finding(s): "
                + "; ".join(listed)
                + (f"; and {more} more (run `fabric verify`)" if more > 0 else "")
            ),
            metadata={**checked, "findings": len(report.findings)},
            allow_retries=False,
        )
    context.log.info(f"verify: clean; checked {report.checked}")
    return dg.Output(0, metadata={**checked, "findings": 0})


@dg.job(
    description="Verify every stored file and the accounting of every task set (fabric verify)."
)
def verify_job() -> None:
    verify_everything()
