"""Tool-call parsing (valid, malformed, several per turn), the calculator, the python tool on hostile code,
and tools loaded from a YAML file (built-in and a user's class)."""

import pytest

from hybridflow.tools import (
    CalculatorTool,
    PythonTool,
    ToolError,
    calculate,
    load_tools,
    parse_tool_calls,
)
from hybridflow.utils.errors import UserError


def test_parsing_valid_several_and_malformed_calls():
    text = (
        'Let me compute. <tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call>\n'
        '<tool_call>\n{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}\n</tool_call>'
        '<tool_call>{"name": calculator}</tool_call><tool_call>[1, 2]</tool_call>'
        '<tool_call>{"name": "x", "arguments": [1]}</tool_call><tool_call>{"name": "late"'
    )
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments) for c in calls[:2]] == [
        ("calculator", {"expression": "2*3"}),
        ("python", {"code": "print(1)"}),
    ]
    assert [c.error for c in calls[:2]] == [None, None]
    assert calls[2].error.startswith("the tool call is not valid JSON (Expecting value at character 9)")
    assert calls[3].error == 'a tool call must be a JSON object with a string "name"'
    assert calls[4].error == '"arguments" must be a JSON object' and calls[4].name == "x"
    assert calls[5].error == "<tool_call> without a closing </tool_call>"
    assert parse_tool_calls("The answer is 6.") == []
    with pytest.raises(ValueError, match="unknown tool-call format 'xml'"):
        parse_tool_calls(text, "xml")


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("123*456", "56088"),
        ("(1+2)*-3", "-9"),
        ("7/2", "3.5"),
        ("2**10 % 1000", "24"),
        ("10/4*2", "5"),
        ("17//5", "3"),
    ],
)
def test_calculator_values(expression, value):
    assert calculate(expression) == value
    assert CalculatorTool().execute({"expression": expression}, "id") == (value, 0.0, {})


@pytest.mark.parametrize(
    ("expression", "error"),
    [
        ("9**9**9", "exponent 387420489 is larger than 100"),
        ("1/0", "division by zero"),
        ("__import__('os').system('id')", "unsupported element"),
        ("(1).real", "unsupported element"),
        ("2 +", "cannot parse"),
        ("10**99**1 * 10**99 ** 1" + "*10**99" * 10, "more than 1000 digits"),
    ],
)
def test_calculator_refuses_what_is_not_plain_arithmetic(expression, error):
    with pytest.raises(ToolError, match=error.replace("*", r"\*")):
        calculate(expression)
    with pytest.raises(ToolError, match="needs"):
        CalculatorTool().execute({"expr": "1"}, "id")


def test_python_tool_returns_output_and_turns_hostile_code_into_tool_errors():
    tool = PythonTool({"timeout_s": 1, "cpu_s": 1, "memory_mb": 256})
    assert tool.execute({"code": "print(sum(range(10)))"}, "id")[0] == "45\n"
    with pytest.raises(ToolError, match=r"^timed out after 1 s \(wall clock\)$"):
        tool.execute({"code": "import time\ntime.sleep(10)"}, "id")
    with pytest.raises(
        ToolError,
        match=r"(?s)exited with code 1\nstdout began: partial\n\n"
        r'Traceback.*File "main.py", line 2.*ZeroDivisionError',
    ):
        tool.execute({"code": "print('partial')\n1/0"}, "id")
    with pytest.raises(UserError, match=r"unknown keys \['timeout'\]"):
        PythonTool({"timeout": 3})


def test_tools_load_from_yaml_with_a_users_class(tmp_path):
    (tmp_path / "mytools.py").write_text(
        "from hybridflow.tools import BaseTool\n\n"
        "class Reverse(BaseTool):\n"
        "    name = 'reverse'\n"
        "    description = 'Reverse a text.'\n"
        "    parameters = {'type': 'object', 'properties': {'text': {'type': 'string'}}}\n\n"
        "    def execute(self, args, instance_id):\n"
        "        return args['text'][::-1] + self.config.get('suffix', ''), 0.5, {}\n"
    )
    (tmp_path / "tools.yaml").write_text(
        f"tools:\n  - class_name: calculator\n  - class_name: {tmp_path / 'mytools.py'}:Reverse\n"
        "    config: {suffix: '!'}\n"
        "  - class_name: hybridflow.tools.python_tool.PythonTool\n"
        "    tool_schema: {type: function, function: {name: run_code, description: d, parameters: {}}}\n"
    )
    tools = load_tools(tmp_path / "tools.yaml")
    assert list(tools) == ["calculator", "reverse", "run_code"]
    assert tools["reverse"].execute({"text": "abc"}, "id") == ("cba!", 0.5, {})
    assert tools["reverse"].schema["function"]["parameters"]["properties"] == {"text": {"type": "string"}}
    assert isinstance(tools["run_code"], PythonTool)
    (tmp_path / "bad.yaml").write_text("tools:\n  - class_name: calculator\n  - class_name: calculator\n")
    with pytest.raises(UserError, match=r"bad.yaml: tools\[1\]: a second tool named 'calculator'"):
        load_tools(tmp_path / "bad.yaml")
    (tmp_path / "bad.yaml").write_text("tools:\n  - class_name: nosuch\n")
    with pytest.raises(
        UserError, match=r"'nosuch' is not a BaseTool subclass; built-in tools: \['calculator', 'python'\]"
    ):
        load_tools(tmp_path / "bad.yaml")
    with pytest.raises(UserError, match="tool config .*missing.yaml not found"):
        load_tools(tmp_path / "missing.yaml")
