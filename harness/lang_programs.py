"""The frontend tutorial's programs, written as its pages write them (only the import differs),
shared by the language's tests against the server and in process."""

from __future__ import annotations

import json

import serving.lang as sgl

# the servers the language's tests start: float32, small pages, no L2; the API backends' tests use the key
LANG_SERVER_ARGS = ["--dtype", "float32", "--page-size", "4", "--max-total-tokens", "8192", "--hicache-ratio", "0"]
API_KEY = "sk-lang-test-0001"
IP_REGEX = r"((25[0-5]|2[0-4]\d|[01]?\d\d?).){3}(25[0-5]|2[0-4]\d|[01]?\d\d?)"
CHARACTER_SCHEMA = json.dumps({
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z ]{1,16}$"},
        "house": {"type": "string", "enum": ["Gryffindor", "Slytherin", "Ravenclaw", "Hufflepuff"]},
        "age": {"type": "integer", "minimum": 10, "maximum": 99},
    },
    "required": ["name", "house", "age"],
    "additionalProperties": False,
})


@sgl.function
def basic_qa(s, question):
    s += sgl.system("You are a helpful assistant than can answer questions.")
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=24))


@sgl.function
def multi_turn_qa(s):
    s += sgl.system("You are a helpful assistant than can answer questions.")
    s += sgl.user("Please give me a list of 3 countries and their capitals.")
    s += sgl.assistant(sgl.gen("first_answer", max_tokens=24))
    s += sgl.user("Please give me another list of 3 countries and their capitals.")
    s += sgl.assistant(sgl.gen("second_answer", max_tokens=24))
    return s


@sgl.function
def tool_use(s, question):
    s += sgl.assistant(
        "To answer this question: " + question + ". I need to use a "
        + sgl.gen("tool", choices=["calculator", "search engine"]) + ". "
    )
    if s["tool"] == "calculator":
        s += sgl.assistant("The math expression is: " + sgl.gen("expression", max_tokens=8))
    elif s["tool"] == "search engine":
        s += sgl.assistant("The key word to search is: " + sgl.gen("word", max_tokens=8))


@sgl.function
def capital(s, country):
    s += "Q: What is the capital of " + country + "?\nA: The capital of " + country + " is "
    s += sgl.select("city", choices=["Paris", "London", "Berlin", "Madrid"])


@sgl.function
def tip_suggestion(s):
    s += (
        "Here are four tips for staying healthy: "
        "1. Balanced Diet. 2. Regular Exercise. 3. Enough Sleep. 4. Drink Water.\n\n"
    )
    forks = s.fork(4)
    for i, f in enumerate(forks):
        f += f"Now, expand tip {i + 1} into a paragraph:\n"
        f += sgl.gen("detailed_tip", max_tokens=12, stop="\n\n")
    forks.join()
    s += "Tip 1:" + forks[0]["detailed_tip"] + "\n"
    s += "Tip 2:" + forks[1]["detailed_tip"] + "\n"
    s += "In summary" + sgl.gen("summary", max_tokens=8)


@sgl.function
def regular_expression_gen(s):
    s += "Q: What is the IP address of the Google DNS servers?\n"
    s += "A: " + sgl.gen("answer", temperature=0, regex=IP_REGEX)


@sgl.function
def character_gen(s, name):
    s += name + " is a character in Harry Potter. Please fill in the following information about this character.\n"
    s += sgl.gen("json_output", max_tokens=64, json_schema=CHARACTER_SCHEMA)


FEW_SHOT = (
    "Answer with the capital city.\n"
    "Country: France. Capital: Paris.\n"
    "Country: Japan. Capital: Tokyo.\n"
    "Country: Italy. Capital: Rome.\n"
    "Country: Canada. Capital: Ottawa.\n"
    "Country: Egypt. Capital: Cairo.\n"
)


@sgl.function
def text_qa(s, question):
    s += FEW_SHOT + "Country: " + question + ". Capital:"
    s += sgl.gen("answer", stop="\n", max_tokens=6)


COUNTRIES = ["Germany", "Spain", "Portugal", "Norway", "Sweden", "Poland", "Greece", "Austria",
             "Belgium", "Ireland", "Finland", "Denmark", "Hungary", "Romania", "Peru", "Chile"]
