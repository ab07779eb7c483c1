"""The one controller: runs any engine through generations, turns events into history and stop
decisions, schedules checkpoints, and acts on the failure policy."""
