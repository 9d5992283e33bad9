"""What the launcher says about a configuration it accepts: a flag that has no effect
in this job, a setting whose consequence a user meets only later. One warning each."""

from __future__ import annotations

import logging

from relaunch._cli_values import Values
from relaunch.config import LaunchConfig

__all__ = ["say_conf_ignored", "say_new_job"]

logger = logging.getLogger("relaunch.cli")


def say_conf_ignored(config: LaunchConfig, values: Values) -> None:
    """--rdzv-conf given to a job that has no rendezvous."""
    logger.warning(
        "%s=%s ignored: a single-node job (%s) has no rendezvous to configure",
        values.label("rdzv_conf"),
        values.text("rdzv_conf"),
        "--standalone" if config.standalone else "--nnodes 1 without a rendezvous endpoint",
    )


def say_new_job(config: LaunchConfig, standalone: bool) -> None:
    """The durable copies are kept by run id: a launch whose id was drawn at random
    restores nothing an earlier launch left there. Said before it matters (after a
    crash of the whole job, when the relaunch starts from step 0)."""
    how = "--standalone draws a new one" if standalone else "none was given (--rdzv-id)"
    instead = " instead of --standalone (--nnodes 1 is single-node too)" if standalone else ""
    logger.warning(
        "--checkpoint-dir: this launch is a new job (run id %s: %s), so it restores "
        "nothing an earlier launch copied to %s; to resume from those copies after the "
        "whole job is restarted, launch with the same --rdzv-id each time%s",
        config.rdzv_id, how, config.checkpoint_dir, instead,
    )  # fmt: skip
