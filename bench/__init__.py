"""`make bench`: flawed/ vs fixed/ vs torch's scaled_dot_product_attention, in one run.

Four sections (`--only` picks some):
  overhead  per-call host overhead at a tiny shape: flawed (the ctypes wrapper), fixed's
            fast_attention, its raw operator and SDPA; wall clock around many calls, µs per call.
  kata      the kata's shapes, float32 (B, S, 64): flawed, fixed, SDPA, and the cost of flawed's
            host round trip (`torch.empty_like(q, device="cpu").to(q.device)`) on its own.
  llm       LLM shapes, bfloat16 (B, H, S, D), forward and forward+backward: fixed and SDPA's
            default, flash and cuDNN backends, in TFLOP/s and as a ratio to the flash backend;
            each row ends with fixed's speed over cuDNN's, the bar on Hopper (SDPA's default
            there; the faster of the cuDNN backend forced and the default, which forcing can
            slow down). The JSON rows carry ratio_to_flash and ratio_to_cudnn. Needs a CUDA GPU.
  args      SDPA's other arguments (a bool or float mask, GQA, head dims 80 and 256, Ev = D/2,
            dropout) and float32 inputs at LLM shapes, bfloat16 but that case, H=16, S=2048
            (B=4) and 8192 (B=1), D=64 and 128, forward and forward+backward: fixed against
            SDPA's default
            and against SDPA's best backend for the case (the fastest of flash, efficient and
            cuDNN that takes the call), whose name the row gives. The JSON rows carry
            ratio_to_sdpa and ratio_to_best. Needs a CUDA GPU.

How it times. Every implementation is first checked once against float32 SDPA (the math backend, an
independent path) on fresh standard-normal inputs; a wrong result is reported as WRONG and never
timed. Then: warm-up calls, and timed runs until a row's time budget or its run cap is spent (at
least `min_runs`); the median is reported. On a GPU each run sits between two CUDA events, and the
runs rotate among input sets that together are several times the L2 cache, so the cache does not
flatter small shapes. On the CPU each run is timed with perf_counter. A row whose single call takes
longer than `--max-call` seconds is reported as skipped, and the whole run stops timing new rows
once `--time-limit` is spent; both say so in the row's status. The llm rows of one shape and pass,
and the args rows of one case, shape and pass, are timed together (alternate): each implementation
runs one batch per round (`--rounds`, 5 by default), so that a drift of the GPU's clock lands on all
of them alike, in orders where each follows every other one equally often, each batch after untimed
calls of its own (on a GPU, in chunks of `--settle` ms, 30 by default, until two chunks' medians
agree within 1%, for at most `--settle-max` ms, 250 by default: what the previous batch left behind,
its clock or heat, is not timed; an H200's clock took about 100 ms to recover after a heavy row,
perf/NOTES.md v59); their rows keep each batch's median, the SM clock NVML read after it, what NVML
said limited that clock (the power cap, heat) and its untimed milliseconds (batch_medians_ms,
batch_sm_clock_mhz, batch_clock_limits, batch_settle_ms; sm_clock_mhz, the clocks' median).

FLOPs as FlashAttention's benchmarks count them: forward 4·B·H·L·S·D, halved when causal; the
backward 2.5x the forward, so forward+backward 3.5x.

Output: a table on stdout, every row in a JSON file (`--json`, default bench.json), and a chart
of the LLM rows (`--png`, default beside the JSON) when matplotlib is installed. A ratio marked
`~` compares two rows whose batch medians spread more than 20% (slowest over fastest): one or two
slow batches (2x, on an H200) moved a median there. `--table bench.json` prints a saved run's
table again, with this version's marks, and times nothing.

The modules: cases (sections, shapes, settings, rows and the float32 reference), backends (what is
timed: flawed/, fixed/, SDPA and its backends; SDPA's refusals and kernel names; machine facts),
timing (how a row is checked and timed: the Bench), alternate (the llm rows' alternating batches
and the SM clock), arguments (the args section: its cases, their
grid, SDPA's best backend), table (the stdout table and the chart) and cli (the options and
main). `python -m bench` runs cli.main.
"""
