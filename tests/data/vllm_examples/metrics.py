"""vLLM's examples/offline_inference/metrics.py (commit 26063889b897), as a vLLM user runs it with kvload.

The calls are the example's: LLM(model=..., disable_log_stats=False), llm.generate(prompts, sampling_params), then
every record of llm.get_metrics() told apart by isinstance against Counter, Gauge, Vector and Histogram; only the
import lines (vllm -> kvload, vllm.v1.metrics.reader -> kvload.metrics) and the model (facebook/opt-125m ->
smollm2-135m) differ. Extra engine keywords come as JSON in argv[1] (the tests add speculative decoding).
"""

import json
import sys

from kvload import LLM, SamplingParams
from kvload.metrics import Counter, Gauge, Histogram, Vector

prompts = ["Hello, my name is", "The capital of France is"]
sampling_params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=16)


def main():
    extra = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
    llm = LLM(model="smollm2-135m", disable_log_stats=False, **extra)
    for output in llm.generate(prompts, sampling_params):
        print(f"Prompt: {output.prompt!r}\nGenerated text: {output.outputs[0].text!r}")
    for metric in llm.get_metrics():
        if isinstance(metric, Gauge):
            print(f"{metric.name} (gauge) = {metric.value}")
        elif isinstance(metric, Counter):
            print(f"{metric.name} (counter) = {metric.value}")
        elif isinstance(metric, Vector):
            print(f"{metric.name} (vector) = {metric.values}")
        elif isinstance(metric, Histogram):
            print(f"{metric.name} (histogram)")
            print(f"    sum = {metric.sum}")
            print(f"    count = {metric.count}")
            for bucket_le, value in metric.buckets.items():
                print(f"    {bucket_le} = {value}")


if __name__ == "__main__":
    main()
