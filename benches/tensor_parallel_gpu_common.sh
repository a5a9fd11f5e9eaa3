# Sourced by benches/tensor_parallel_gpu*.sh on the GPU device.
. /tmp/stash/env.sh
# mlx.launch's entry point (the wheel's module has no __main__).
LAUNCH=(python3 -c 'import sys; from mlx._distributed_utils.launch import main; sys.argv[0] = "mlx.launch"; main()')
# Waits for the server on port $1 whose process is $2 (gives up when it exits).
wait_ready() { for i in $(seq 1 240); do curl -sf localhost:$1/health >/dev/null && return 0; kill -0 $2 2>/dev/null || return 1; sleep 1; done; return 1; }
