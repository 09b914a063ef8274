"""What a process of a multi-process job does when something goes wrong.

`keras_dist.initialize()` installs these once the job has several processes:
`lifecycle` ends a rank promptly and cleanly on an uncaught exception, on
SIGTERM/SIGINT and when the launcher that started it dies.
"""
