"""The test and fault harness: what the tests and the benchmarks share to run tiers, pipelines,
faults and ledgers. Not part of the installed package (pyproject's package list names only
``rollstream*``); the tests and ``bench/`` import it from the repository root.

Tiers, services and configs
    tiers           :class:`TierProcess`, the one way to start a tier (``rollstream <tier>`` in a
                    process of its own); :func:`running`, a set of them for one block
    services        Kafka and Redis outside pytest, the tiny model, unique names, free ports
    configs         :func:`pipeline_config`, the one config builder; :func:`make_config`; files
    procstats       memory and CPU time of a process tree, from /proc
    pipeline        a whole supervised pipeline of tier processes with a stand-in trainer
    outcome_report  the report text of a pipeline run's outcome
    waits           bounded waits that name the step that did not finish
    reports         the ``show_report`` fixture's type
Faults and what they must not break
    cluster         a replicated local Kafka cluster: whom to kill, when it recovered
    budget_watch    the watch on the staleness bound while a block runs
    ledger          every prompt's fate from the topics; bounded reads of a topic
    torch_tripwire  a tier's command line that fails when it imports torch
    trainer_job     a small torchrun trainer job (a script); trainer_jobs runs and hurts it
Stand-ins and audits
    fake_sglang     the SGLang 0.5.23 stand-in server; token_ledger, the tokens it produced
    ledger_audit    each token's version tag checked against the stand-ins' ledgers
    logprob_audit   each token's version tag checked by its logprob recomputed per version
    checkpoints     weights of distinct versions; the session's vLLM server back on version 0
    shared_sglang   rollout workers sharing SGLang stand-ins: configs, feeds, a version publisher
    fakes           test doubles of the engine, workflows and tokenizer
    agent_model     a tiny model taught one tool-calling conversation
    tiny_models     the fault tests' tiny offline model
Records written and read by the tests
    episodes        scored episodes, rejections, failures and complete groups
    trajectories    trajectories of one and several turns, for the dump and replay tests
    group_rows      a group's rows as the trainer lays them out
    images          images, vision prompts and fresh forward passes for the vision tests
    strategies      Hypothesis strategies of wire records and broken bytes (the fuzz tests)
    producer_feed   a producer's config and dataset, its prompts read back, the budget it sees
    rollout_feed    prompts published to, and episodes read from, a rollout worker's topics
    scored_feed     scored episodes written to, and outcomes read from, the grouping tier
    batches_feed    complete groups written straight to the batches topic
    batch_checks    what a trainer receives: batches acked, tensors and logprobs checked
    compose         compose.yaml as docker compose renders it
    health_server   a health endpoint served on a free local port
"""
