"""Trains several command lines one after another in one process (one rank, gloo, CPU).

    python tests/_flag_matrix_worker.py CASES.json RESULTS.json

CASES.json maps a case name to its argv. Each case runs pretrain_moe.main(argv), the launcher's
whole path (defaults, preflight, megatron's validation, pretrain()), then megatron's own
destroy_global_state(), its MoE metrics tracker, the expert-load patch's router registry
and the process group are torn down so the next case starts clean: one
process start (~8 s of imports) for all of them. RESULTS.json maps each name to
{"outcome": "trained" | "refused" | "crashed", "detail": ...}; "trained" means pretrain()
returned having consumed --train-iters x --global-batch-size samples.
"""

import json
import os
import socket
import sys
import traceback


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_case(argv: list[str]) -> dict:
    import torch

    import pretrain_moe
    from moe_launcher.runtime.refusals import PreflightError

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    try:
        pretrain_moe.main(argv)
        from megatron.training import get_args

        args = get_args()
        # megatron counts the samples it trained on in args; the iteration is a local of train().
        expected = args.train_iters * args.global_batch_size
        if args.consumed_train_samples != expected:
            return {"outcome": "crashed", "detail": f"trained on {args.consumed_train_samples} "
                                                    f"samples, not {expected}"}
        return {"outcome": "trained", "detail": f"{args.train_iters} iterations"}
    except PreflightError as error:
        return {"outcome": "refused", "detail": error.line()}
    except BaseException as error:  # noqa: BLE001 -- the test reports what crashed
        return {"outcome": "crashed",
                "detail": "".join(traceback.format_exception(error))[-3000:]}
    finally:
        from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker
        from megatron.training.training import destroy_global_state

        destroy_global_state()
        # Sized by the first model's layer count; destroy_global_state leaves it.
        destroy_moe_metrics_tracker()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        # The expert-load patch's registry of routers outlives the model here (something
        # still references the old model); one process per run never needs this reset.
        from megatron_patches.moe import expert_load_metrics

        expert_load_metrics._ROUTERS.clear()


def main(cases_path: str, results_path: str) -> None:
    with open(cases_path) as f:
        cases = json.load(f)
    results = {}
    for name, argv in cases.items():
        print(f"[flag-matrix] case {name}", flush=True)
        results[name] = run_case(argv)
        print(f"[flag-matrix] case {name}: {results[name]['outcome']}", flush=True)
        with open(results_path, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:])
