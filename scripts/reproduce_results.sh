#!/usr/bin/env bash
# Re-measure the results the book plots from book/results/, on this machine.
#
#   bash scripts/reproduce_results.sh            # everything (about 50 minutes on 2 cores)
#   bash scripts/reproduce_results.sh ring step  # some of it
#
# Results carry the git commit they were measured at, so the tree must be
# clean: commit first, measure, then commit the results. Keep other work off
# the machine while it runs: the benchmarks time things side by side, but a
# busy machine still adds noise.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ -n "$(git status --porcelain --untracked-files=no)" ]; then
    echo "reproduce_results: the tree has uncommitted changes; commit them first so results name a real commit" >&2
    exit 2
fi

run() {  # run RANKS MODULE ARGS...: torchrun on this machine's CPU with gloo, the cores shared among the ranks
    local ranks=$1; shift
    local threads=$(( $(nproc) / ranks ))
    OMP_NUM_THREADS=$(( threads > 0 ? threads : 1 )) \
        python -m torch.distributed.run --standalone --nproc_per_node="$ranks" -m "$@" --device cpu
}

what=("$@")
[ ${#what[@]} -eq 0 ] && what=(bad-inputs memory ddp ring shard step fsdp sweep)

for item in "${what[@]}"; do
    case "$item" in
    ring)  # the ring all-reduce against gloo's, 4 KB to 256 MB, then three repeated runs at 16 and 64 MB
        for n in 2 4; do
            run "$n" distlab.bench.allreduce --sizes 4KB:256MB --out book/results/ring
            for r in 1 2 3; do
                run "$n" distlab.bench.allreduce --sizes 16MB,64MB --impls ring,torch --max-repeats 60 --min-repeats 30 \
                    --out book/results/ring --name "acceptance-${n}xcpu-run$r"
            done
        done ;;
    shard)  # reduce-scatter and all-gather, torch's and the ring's
        for n in 2 4; do
            run "$n" distlab.bench.shard_collectives --sizes 1MB:64MB --out book/results/zero
        done ;;
    step)  # one optimizer step of every strategy on gpt-mini, side by side
        run 2 distlab.bench.step --model gpt-mini --strategies ddp,zero1,zero2,zero3,fsdp --steps 15 --out book/results/zero ;;
    memory)  # every byte a rank holds in one step of each strategy (gpt-tiny, 1 to 4 ranks), and ZeRO-3's timeline
        for n in 1 2 3 4; do
            run "$n" distlab.bench.step --model gpt-tiny --seq-len 64 --steps 2 --warmup 1 --out book/results/zero \
                --name "memory-gpt-tiny-${n}xcpu"
        done
        run 2 distlab.bench.step --model gpt-tiny --seq-len 64 --steps 2 --warmup 1 --no-reshard-after-forward \
            --strategies zero3,fsdp --out book/results/zero --name memory-gpt-tiny-keep-2xcpu
        for n in 2 4; do
            run "$n" distlab.bench.step --model gpt-mini --batch-size 1 --seq-len 32 --strategies zero3 --steps 2 \
                --warmup 1 --out book/results/zero --name "timeline-gpt-mini-${n}xcpu"
        done
        run 2 distlab.bench.step --model gpt-mini --batch-size 1 --seq-len 32 --strategies zero3 --steps 2 --warmup 1 \
            --no-reshard-after-forward --out book/results/zero --name timeline-gpt-mini-keep-2xcpu ;;
    fsdp)  # one optimizer step of FSDP2 with each option on gpt-mini, on 2 and 4 ranks
        for n in 2 4; do
            run "$n" distlab.bench.fsdp_options --model gpt-mini --steps 10 --out book/results/fsdp
        done ;;
    ddp)  # DDP's step against the course's wrappers and no communication, by bucket size, on the CNN and ResNet-18
        run 2 distlab.bench.ddp_step --model cnn --batch-size 64 --bucket-caps 0.25,1,5,25 --steps 30 --warmup 5 \
            --out book/results/ddp
        run 2 distlab.bench.ddp_step --model resnet18 --batch-size 16 --bucket-caps 1,5,25 --profile-cap 5 --steps 25 \
            --warmup 3 --out book/results/ddp ;;
    bad-inputs)  # every bad command line of distlab.demos.bad_inputs: what the user sees (the troubleshooting table)
        python -m distlab.demos.bad_inputs --out book/results/troubleshooting ;;
    sweep)  # DDP against ZeRO-1/2/3 and FSDP2 on GPT presets, with the cost model's calibration (about 20 minutes)
        for n in 1 2 4; do
            run "$n" distlab.bench.sweep --out book/results/sweep
        done ;;
    compile)  # a DDP step compiled by inductor (gcc) against eager, and each rank's first (compiling) step
        run 2 distlab.bench.compile --out book/results/compile ;;
    *)
        echo "reproduce_results: unknown item $item (use ring, shard, step, memory, fsdp, ddp, bad-inputs, sweep, compile)" >&2
        exit 2 ;;
    esac
done
