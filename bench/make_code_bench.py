#!/usr/bin/env python3
"""Writes bench/code_edit.jsonl and bench/code_gen.jsonl, the speculative-decoding workloads of
scripts/bench_spec_real.sh: code editing (the answer rewrites code that is in the prompt, so most of
it can be copied) and code generation (nothing to copy). One {"prompt", "max_tokens"} per line, for
`specula bench serve --endpoint /v1/chat/completions --dataset file`. Run it again after editing."""
import json
import pathlib

SNIPPETS = {
"inventory.py": '''class Inventory:
    def __init__(self):
        self.items = {}

    def add(self, name, qty):
        if qty <= 0:
            raise ValueError("quantity must be positive")
        self.items[name] = self.items.get(name, 0) + qty

    def remove(self, name, qty):
        have = self.items.get(name, 0)
        if qty > have:
            raise ValueError("not enough " + name)
        self.items[name] = have - qty
        if self.items[name] == 0:
            del self.items[name]

    def total(self):
        return sum(self.items.values())

    def report(self):
        lines = []
        for name in sorted(self.items):
            lines.append(name + ": " + str(self.items[name]))
        return "\\n".join(lines)
''',
"stats.py": '''def mean(values):
    if not values:
        return 0.0
    return sum(values) / len(values)


def variance(values):
    if len(values) < 2:
        return 0.0
    m = mean(values)
    return sum((v - m) ** 2 for v in values) / (len(values) - 1)


def median(values):
    s = sorted(values)
    n = len(s)
    if n == 0:
        return 0.0
    if n % 2 == 1:
        return s[n // 2]
    return (s[n // 2 - 1] + s[n // 2]) / 2


def summary(values):
    return {
        "mean": mean(values),
        "variance": variance(values),
        "median": median(values),
        "count": len(values),
    }
''',
"queue.rs": '''pub struct Queue<T> {
    items: Vec<T>,
    capacity: usize,
}

impl<T> Queue<T> {
    pub fn new(capacity: usize) -> Self {
        Queue { items: Vec::new(), capacity }
    }

    pub fn push(&mut self, item: T) -> bool {
        if self.items.len() >= self.capacity {
            return false;
        }
        self.items.push(item);
        true
    }

    pub fn pop(&mut self) -> Option<T> {
        if self.items.is_empty() {
            None
        } else {
            Some(self.items.remove(0))
        }
    }

    pub fn len(&self) -> usize {
        self.items.len()
    }

    pub fn is_full(&self) -> bool {
        self.items.len() == self.capacity
    }
}
''',
"users.js": '''function createUser(name, email, age) {
  if (!name || !email) {
    throw new Error("name and email are required");
  }
  return { name: name, email: email, age: age, active: true };
}

function deactivate(user) {
  user.active = false;
  return user;
}

function findByEmail(users, email) {
  for (let i = 0; i < users.length; i++) {
    if (users[i].email === email) {
      return users[i];
    }
  }
  return null;
}

function activeUsers(users) {
  const result = [];
  for (let i = 0; i < users.length; i++) {
    if (users[i].active) {
      result.push(users[i]);
    }
  }
  return result;
}
''',
"server.py": '''import json
from http.server import BaseHTTPRequestHandler, HTTPServer

NOTES = []


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"notes": NOTES}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        length = int(self.headers.get("Content-Length", 0))
        data = json.loads(self.rfile.read(length))
        NOTES.append(data["text"])
        self.send_response(201)
        self.end_headers()


def main():
    server = HTTPServer(("127.0.0.1", 8080), Handler)
    server.serve_forever()


if __name__ == "__main__":
    main()
''',
"matrix.go": '''package matrix

type Matrix struct {
	Rows int
	Cols int
	Data []float64
}

func New(rows, cols int) *Matrix {
	return &Matrix{Rows: rows, Cols: cols, Data: make([]float64, rows*cols)}
}

func (m *Matrix) At(i, j int) float64 {
	return m.Data[i*m.Cols+j]
}

func (m *Matrix) Set(i, j int, v float64) {
	m.Data[i*m.Cols+j] = v
}

func (m *Matrix) Mul(o *Matrix) *Matrix {
	out := New(m.Rows, o.Cols)
	for i := 0; i < m.Rows; i++ {
		for j := 0; j < o.Cols; j++ {
			sum := 0.0
			for k := 0; k < m.Cols; k++ {
				sum += m.At(i, k) * o.At(k, j)
			}
			out.Set(i, j, sum)
		}
	}
	return out
}
''',
"parser.py": '''def tokenize(text):
    tokens = []
    i = 0
    while i < len(text):
        c = text[i]
        if c.isspace():
            i += 1
        elif c.isdigit():
            j = i
            while j < len(text) and text[j].isdigit():
                j += 1
            tokens.append(("num", int(text[i:j])))
            i = j
        elif c in "+-*/()":
            tokens.append(("op", c))
            i += 1
        else:
            raise SyntaxError("unexpected character " + c)
    return tokens


def evaluate(tokens):
    total = 0
    sign = 1
    for kind, value in tokens:
        if kind == "num":
            total += sign * value
        elif value == "+":
            sign = 1
        elif value == "-":
            sign = -1
    return total
''',
"cache.ts": '''export class LruCache<V> {
  private map = new Map<string, V>();

  constructor(private capacity: number) {}

  get(key: string): V | undefined {
    const value = this.map.get(key);
    if (value === undefined) {
      return undefined;
    }
    this.map.delete(key);
    this.map.set(key, value);
    return value;
  }

  set(key: string, value: V): void {
    if (this.map.has(key)) {
      this.map.delete(key);
    }
    this.map.set(key, value);
    if (this.map.size > this.capacity) {
      const oldest = this.map.keys().next().value;
      this.map.delete(oldest);
    }
  }

  size(): number {
    return this.map.size;
  }
}
''',
}

EDITS = {
"inventory.py": ["Rename the method `total` to `total_quantity` everywhere.", "Add type hints to every method signature."],
"stats.py": ["Rename the parameter `values` to `data` in every function.", "Make `summary` also return the minimum and maximum under the keys \"min\" and \"max\"."],
"queue.rs": ["Replace the `Vec<T>` with a `std::collections::VecDeque<T>` so that `pop` is O(1).", "Add doc comments (`///`) to the struct and every method."],
"users.js": ["Rewrite the two loops with `Array.prototype.find` and `Array.prototype.filter`.", "Convert the code to use `const` arrow functions instead of function declarations."],
"server.py": ["Change the port from 8080 to 9000 and make `do_POST` reply with the new note's index as JSON.", "Add a `do_DELETE` method that clears all notes and replies 204."],
"matrix.go": ["Add an `Add(o *Matrix) *Matrix` method that adds two matrices element by element.", "Make `Mul` return an error when the dimensions do not match: change its signature to `(*Matrix, error)`."],
"parser.py": ["Rename `tokenize` to `lex` and `evaluate` to `evaluate_sum`, updating every use.", "Make `tokenize` also accept decimal numbers such as 3.25 (tokens of kind \"num\" with a float value)."],
"cache.ts": ["Add a `delete(key: string): boolean` method.", "Rename the class to `LeastRecentlyUsedCache` and the field `map` to `entries`."],
}

GEN = [
    "Write a Python function `is_palindrome(s: str) -> bool` that ignores case and non-alphanumeric characters, with a docstring and three doctest examples.",
    "Write a Rust function that returns the n-th Fibonacci number using iteration, with unit tests.",
    "Write a JavaScript function that debounces another function, with a short usage example.",
    "Write a Python class `Stack` with push, pop, peek and is_empty methods, and a few asserts that test it.",
    "Write a Go function that reverses a slice of integers in place, and a table-driven test for it.",
    "Write a Python script that reads a CSV file given on the command line and prints the sum of each numeric column.",
    "Write a TypeScript interface for a blog post (title, body, tags, published date) and a function that sorts posts by date.",
    "Write a SQL query that returns the ten customers with the highest total order amount, given tables customers(id, name) and orders(id, customer_id, amount).",
    "Write a Rust struct `Point { x: f64, y: f64 }` with methods for distance to another point and for the midpoint, with tests.",
    "Write a Python function that merges two sorted lists into one sorted list without using sort(), with tests.",
    "Write a bash script that counts the lines of every .py file in a directory tree and prints the total.",
    "Write a Python function that validates an email address with a regular expression, and explain the pattern in a comment.",
    "Write a C function that computes the length of a null-terminated string without using strlen.",
    "Write a Java class `Counter` that is safe to use from several threads, with increment and get methods.",
    "Write a Python generator that yields the prime numbers below n using a sieve.",
    "Write a JavaScript function that deep-clones a plain object that contains nested objects and arrays.",
]


def fence(name):
    return {"py": "python", "rs": "rust", "js": "javascript", "ts": "typescript", "go": "go"}[name.rsplit(".", 1)[1]]


def main():
    here = pathlib.Path(__file__).parent
    with open(here / "code_edit.jsonl", "w") as f:
        for i in range(2):
            for name, code in SNIPPETS.items():
                prompt = f"{EDITS[name][i]} Reply with the complete updated file `{name}` in one code block and nothing else.\n\n```{fence(name)}\n{code}```"
                f.write(json.dumps({"prompt": prompt, "max_tokens": 512}) + "\n")
    with open(here / "code_gen.jsonl", "w") as f:
        for p in GEN:
            f.write(json.dumps({"prompt": p, "max_tokens": 256}) + "\n")


if __name__ == "__main__":
    main()
