"""What a process of a multi-process job does when something goes wrong.

`lifecycle` ends a rank promptly and cleanly on an uncaught exception, on
SIGTERM/SIGINT and when the launcher that started it dies (installed by
`keras_dist.initialize()` once the job has several processes); `heartbeat`
records each rank's progress for the hang doctor (`keras_dist.cluster.
hang_doctor`) and runs its watchdog; `own_failure` tells whether a rank's
exception is a failure of its own or may be another rank's consequence.
"""
