"""Prompts shared by the logits-oracle tests (text; tokenized with the oracle tokenizer)."""

ENGLISH = "The capital of France is Paris. It is known for the Eiffel Tower, the Louvre museum and its cafes, and"

CODE = '''def fibonacci(n: int) -> int:
    """Return the n-th Fibonacci number."""
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


if __name__ == "__main__":
    print([fibonacci(i) for i in range(10)])
'''

NON_LATIN = "Москва — столица России. 北京是中国的首都。 القاهرة هي عاصمة مصر. Αθήνα είναι η πρωτεύουσα της Ελλάδας."

CHAT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nWhat is 12 + 30? Answer briefly.<|im_end|>\n"
    "<|im_start|>assistant\n"
)

LONG = (
    "Once upon a time, in a small village at the edge of a great forest, there lived a young girl named Elara. "
    "Every morning she walked to the river to fetch water for her grandmother, who had grown too old to carry the "
    "heavy buckets herself. The path wound between tall oak trees and patches of wild strawberries, and Elara knew "
    "every stone and root along the way. One autumn day, as the leaves turned gold and red, she noticed a small fox "
    "limping beside the water. Its front paw was caught in an old piece of rope. Elara knelt down slowly, speaking "
    "softly so as not to frighten it, and carefully untangled the rope. The fox looked at her for a long moment "
    "before disappearing into the bushes. That night, a storm rolled over the hills. Thunder shook the windows and "
    "rain hammered the roof. In the morning, the river had flooded the lower fields, and the bridge to the market "
    "town had been washed away. The villagers gathered in the square, worried about how they would sell their "
    "harvest before winter. Elara remembered a narrow trail her grandfather had once shown her, a path that climbed "
    "over the ridge and came down on the far side of the valley. But the trail was old and overgrown, and no one had "
    "used it for years. As she stood at the edge of the forest wondering where to begin, she saw the fox again. It "
    "sat on a rock a few steps ahead, watching her, then trotted up the hill and stopped to look back. Elara followed. "
    "All day long the fox led her along the forgotten trail, past fallen trees and across shallow streams, until at "
    "last they reached the top of the ridge. Below, she could see the rooftops of the market town shining in the "
    "afternoon sun. When she returned to the village that evening, she told everyone about the path. The next day, "
    "the villagers cleared the trail together, and by the end of the week their carts were rolling toward the town. "
    "From then on, the people of the village said that the forest looked after those who were kind to it, and"
)

DIGITS_URL = "Call 555-0123 before 2024-06-30 or visit https://example.com/a/b?q=1234567&x=3.14159 for details."

PROMPTS = {
    "english": ENGLISH,
    "code": CODE,
    "non_latin": NON_LATIN,
    "chat": CHAT,
    "long": LONG,
    "digits_url": DIGITS_URL,
}
