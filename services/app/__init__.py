"""The application layer: what starts and drives the services as a whole.

    megha up / megha <role> ──runner.py──▶ GM, LM, worker host, predictor (processes or one)
    megha up, live benchmarks ──supervisor.py──▶ child processes, restarted, stopped
    megha submit/job/logs/cancel/status/drain ──operator.py──▶ GMs and LMs over gRPC

It imports the services below it and nothing above (the CLI, the load generator): what
`megha up --replay` replays is handed in (``operator.Workload``).
"""
