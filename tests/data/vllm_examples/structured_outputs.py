"""vLLM's examples/offline_inference/structured_outputs.py (commit 043cd1a182d3), as a vLLM user runs it with kvload.

The calls are the example's: StructuredOutputsParams from the sampling_params module with choice=, regex= (and
stop=["\\n"]), json= (a pydantic model's schema) and grammar= (an EBNF grammar), each in a SamplingParams given to
llm.generate(prompts=..., sampling_params=...), with LLM(model=..., max_model_len=100); only the import lines
(vllm -> kvload; that commit's misspelled StructuredOuputsParams as the class's own name) and the model
(Qwen/Qwen2.5-3B-Instruct -> smollm2-135m) differ.
"""

from enum import Enum

from pydantic import BaseModel

from kvload import LLM, SamplingParams
from kvload.sampling_params import StructuredOutputsParams


class CarType(str, Enum):  # noqa: UP042 (the example's own spelling)
    sedan = "sedan"
    suv = "SUV"
    truck = "Truck"
    coupe = "Coupe"


class CarDescription(BaseModel):
    brand: str
    model: str
    car_type: CarType


SQL = """
root ::= select_statement
select_statement ::= "SELECT " column " from " table " where " condition
column ::= "col_1 " | "col_2 "
table ::= "table_1 " | "table_2 "
condition ::= column "= " number
number ::= "1 " | "2 "
"""

CASES = [
    ("Choice", "Classify this sentiment: vLLM is wonderful!",
     SamplingParams(structured_outputs=StructuredOutputsParams(choice=["Positive", "Negative"]))),
    ("Regex", "Generate an email address for Alan Turing, who works in Enigma. End in .com and new line. Example "
              "result: alan.turing@enigma.com\n",
     SamplingParams(structured_outputs=StructuredOutputsParams(regex=r"\w+@\w+\.com\n"), stop=["\n"])),
    ("JSON", "Generate a JSON with the brand, model and car_type of the most iconic car from the 90's",
     SamplingParams(structured_outputs=StructuredOutputsParams(json=CarDescription.model_json_schema()))),
    ("Grammar", "Generate an SQL query to show the 'username' and 'email' from the 'users' table.",
     SamplingParams(structured_outputs=StructuredOutputsParams(grammar=SQL))),
]


def main():
    llm = LLM(model="smollm2-135m", max_model_len=100)
    for title, prompt, sampling_params in CASES:
        outputs = llm.generate(prompts=prompt, sampling_params=sampling_params)
        print(f"{'-' * 50}\nStructured outputs by {title}: {outputs[0].outputs[0].text}\n{'-' * 50}")


if __name__ == "__main__":
    main()
