//! The instruction prompts the head is distilled on: templates x topics over code, maths, lists,
//! prose, questions and several languages, assembled here (nothing is downloaded). Every prompt
//! belongs to the training split or the held-out split by its *topic*, so a held-out prompt never
//! shares its subject with a training prompt. Deterministic: the same seed gives the same lists.

use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Which split a prompt belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    Train,
    HeldOut,
}

/// Every 5th topic of each list (index 4, 9, ...) is held out.
fn split_of(topic_index: usize) -> Split {
    if topic_index % 5 == 4 {
        Split::HeldOut
    } else {
        Split::Train
    }
}

const CODE_TASKS: &[&str] = &[
    "reverses a string",
    "checks whether a number is prime",
    "returns the n-th Fibonacci number",
    "counts the vowels in a sentence",
    "merges two sorted lists",
    "removes duplicates from a list while keeping the order",
    "computes the factorial of a number",
    "finds the largest element of an array",
    "checks whether a word is a palindrome",
    "converts Celsius to Fahrenheit",
    "sorts a list with bubble sort",
    "parses a date in the format YYYY-MM-DD",
    "computes the average of a list of numbers",
    "counts how often each word appears in a text",
    "flattens a nested list",
    "implements binary search",
    "reads a file and prints the number of lines",
    "returns the greatest common divisor of two integers",
    "validates an email address with a simple rule",
    "transposes a matrix",
    "capitalizes the first letter of every word",
    "generates all permutations of a short list",
    "implements a stack with push and pop",
    "computes the sum of the digits of a number",
    "checks whether two strings are anagrams",
];
const CODE_LANGS: &[&str] = &["Python", "JavaScript", "Rust", "C", "Go", "Java"];
const CODE_TEMPLATES: &[&str] = &[
    "Write a {lang} function that {task}.",
    "Show me how to write a function in {lang} that {task}, with a short explanation.",
    "I am learning {lang}. Can you write a small program that {task}?",
    "Explain step by step how a {lang} function that {task} works, then give the code.",
];

const MATH_TEMPLATES: &[&str] = &[
    "What is {a} times {b}? Explain your steps.",
    "Solve for x: {a}x + {b} = {c}.",
    "A shop sells pencils for {a} cents each. How much do {b} pencils cost?",
    "What is {a} plus {b} minus {c}?",
    "A train travels {a} kilometers in {b} hours. What is its average speed?",
    "What is {a} percent of {c}?",
    "Is {c} divisible by {a}? Explain why.",
    "A rectangle is {a} meters long and {b} meters wide. What are its area and perimeter?",
    "If I have {c} apples and give away {a}, how many are left?",
    "What is the square of {a}, and what is the square root of {sq}?",
];

const LIST_THINGS: &[&str] = &[
    "healthy breakfast ideas",
    "tips for learning a new language",
    "ways to save money",
    "famous scientists and what they discovered",
    "things to pack for a camping trip",
    "reasons to exercise regularly",
    "popular programming languages",
    "ideas for a rainy afternoon",
    "benefits of reading books",
    "common mistakes in job interviews",
    "fruits that are rich in vitamin C",
    "ways to reduce stress",
    "planets of the solar system with one fact each",
    "tips for writing a good essay",
    "board games for families",
    "ways to be more productive at work",
    "animals that live in the ocean",
    "houseplants that are easy to care for",
    "safety rules in a chemistry lab",
    "questions to ask when buying a used car",
];
const LIST_TEMPLATES: &[&str] = &["List {n} {thing}.", "Give me {n} {thing}, as a numbered list.", "What are {n} {thing}? Use bullet points."];

const PROSE_SUBJECTS: &[&str] = &[
    "a lighthouse keeper who finds a message in a bottle",
    "a robot learning to paint",
    "a cat that wants to become a chef",
    "the first day at a new school",
    "a storm over a small fishing village",
    "a friendship between a dragon and a knight",
    "a lost dog finding its way home",
    "an astronaut looking at the Earth",
    "a baker who wakes up before sunrise",
    "a forest in autumn",
    "a city at night",
    "a grandmother's old recipe book",
    "a child who discovers a secret garden",
    "the ocean at dawn",
    "a musician playing in the rain",
    "a library that never closes",
    "a mountain village in winter",
    "a journey on an old train",
    "a scientist who makes an unexpected discovery",
    "a market on a sunny Saturday",
];
const PROSE_TEMPLATES: &[&str] = &[
    "Write a short story about {s}.",
    "Write a short poem about {s}.",
    "Describe {s} in one paragraph.",
    "Write the opening paragraph of a novel about {s}.",
    "Write a haiku about {s}, then explain it.",
    "Tell a funny story about {s}.",
];

const CONCEPTS: &[&str] = &[
    "photosynthesis",
    "gravity",
    "the water cycle",
    "inflation",
    "machine learning",
    "the internet",
    "vaccines",
    "climate change",
    "democracy",
    "black holes",
    "the stock market",
    "electricity",
    "DNA",
    "recycling",
    "the French Revolution",
    "volcanoes",
    "the immune system",
    "renewable energy",
    "supply and demand",
    "the Roman Empire",
    "earthquakes",
    "compound interest",
    "the moon's phases",
    "blockchain",
    "sleep",
];
const CONCEPT_TEMPLATES: &[&str] = &[
    "Explain {c} in simple terms.",
    "What is {c}? Give a short answer.",
    "Explain {c} to a ten-year-old.",
    "What are the main advantages and disadvantages of {c}?",
    "Write a short paragraph about the history of {c}.",
];

const EMAIL_TEMPLATES: &[&str] = &[
    "Write a polite email to {who} about {what}.",
    "Write a short message to {who} explaining {what}.",
];
const EMAIL_WHO: &[&str] = &["my manager", "a teacher", "a landlord", "a customer", "a neighbour", "a colleague", "my team", "a friend", "a hotel", "a client"];
const EMAIL_WHAT: &[&str] = &[
    "a delayed project",
    "a broken heater",
    "a change of schedule",
    "a request for a day off",
    "a missing package",
    "a team dinner next week",
    "a new office policy",
    "a late payment",
    "a birthday party",
    "a meeting next Monday",
];

/// (language, templates, topics) for prompts written in other languages.
const FOREIGN: &[(&str, &[&str], &[&str])] = &[
    (
        "fr",
        &["Explique {t} en quelques phrases.", "Écris un court poème sur {t}.", "Donne trois conseils sur {t}."],
        &["le soleil", "la cuisine française", "les vacances d'été", "l'amitié", "la musique", "les voyages en train", "le sport", "la mer", "les livres", "le jardinage"],
    ),
    (
        "es",
        &["Explica {t} en pocas palabras.", "Escribe un poema corto sobre {t}.", "Dame tres consejos sobre {t}."],
        &["el café", "la familia", "el fútbol", "las montañas", "la lluvia", "el trabajo en equipo", "la comida sana", "los animales", "la ciudad", "el verano"],
    ),
    (
        "de",
        &["Erkläre {t} in einfachen Worten.", "Schreibe ein kurzes Gedicht über {t}.", "Nenne drei Tipps zum Thema {t}."],
        &["den Wald", "das Lernen", "die Zeit", "den Winter", "das Reisen", "die Gesundheit", "das Kochen", "die Freundschaft", "den Fluss", "die Stadt"],
    ),
    (
        "it",
        &["Spiega {t} in poche frasi.", "Scrivi una breve poesia su {t}."],
        &["la pizza", "il mare", "l'arte", "la primavera", "la famiglia", "il calcio", "la musica", "la luna", "il cinema", "la storia"],
    ),
    (
        "pt",
        &["Explique {t} em poucas palavras.", "Escreva um pequeno texto sobre {t}."],
        &["o oceano", "a escola", "o carnaval", "a natureza", "o futebol", "a tecnologia", "a chuva", "a cidade", "a música", "o tempo"],
    ),
];
const TRANSLATE_LANGS: &[&str] = &["French", "Spanish", "German", "Italian"];
const SENTENCES: &[&str] = &[
    "The weather is nice today.",
    "I would like a cup of tea, please.",
    "Where is the train station?",
    "My brother works in a hospital.",
    "We are going to the beach tomorrow.",
    "This book is very interesting.",
    "Can you help me find my keys?",
    "The children are playing in the park.",
    "I have been learning to cook.",
    "The museum opens at nine o'clock.",
    "She bought a new bicycle last week.",
    "Please close the window.",
    "How much does this cost?",
    "The meeting has been moved to Friday.",
    "I love walking by the river.",
];

/// Every prompt of one split, in a fixed order before shuffling.
fn candidates(split: Split, rng: &mut ChaCha8Rng) -> Vec<String> {
    let mut out = Vec::new();
    let keep = |i: usize| split_of(i) == split;
    for (i, task) in CODE_TASKS.iter().enumerate().filter(|(i, _)| keep(*i)) {
        for (j, tmpl) in CODE_TEMPLATES.iter().enumerate() {
            for lang in CODE_LANGS.iter().skip((i + j) % 3).step_by(2) {
                out.push(tmpl.replace("{lang}", lang).replace("{task}", task));
            }
        }
    }
    // maths: the template index decides the split; numbers are drawn from the seed
    for (_, tmpl) in MATH_TEMPLATES.iter().enumerate().filter(|(i, _)| keep(*i)) {
        for _ in 0..40 {
            let (a, b) = (rng.gen_range(2..60u32), rng.gen_range(2..40u32));
            let c = rng.gen_range(a + b..400);
            let sq = [16u32, 25, 36, 49, 64, 81, 100, 121, 144, 169, 196, 225][rng.gen_range(0..12)];
            out.push(tmpl.replace("{a}", &a.to_string()).replace("{b}", &b.to_string()).replace("{c}", &c.to_string()).replace("{sq}", &sq.to_string()));
        }
    }
    for (_, thing) in LIST_THINGS.iter().enumerate().filter(|(i, _)| keep(*i)) {
        for tmpl in LIST_TEMPLATES {
            for n in [3, 5, 7, 10] {
                out.push(tmpl.replace("{n}", &n.to_string()).replace("{thing}", thing));
            }
        }
    }
    for (_, s) in PROSE_SUBJECTS.iter().enumerate().filter(|(i, _)| keep(*i)) {
        for tmpl in PROSE_TEMPLATES {
            out.push(tmpl.replace("{s}", s));
        }
    }
    for (_, c) in CONCEPTS.iter().enumerate().filter(|(i, _)| keep(*i)) {
        for tmpl in CONCEPT_TEMPLATES {
            out.push(tmpl.replace("{c}", c));
        }
    }
    for (i, what) in EMAIL_WHAT.iter().enumerate().filter(|(i, _)| keep(*i)) {
        for (j, tmpl) in EMAIL_TEMPLATES.iter().enumerate() {
            for who in EMAIL_WHO.iter().skip((i + j) % 3).step_by(3) {
                out.push(tmpl.replace("{who}", who).replace("{what}", what));
            }
        }
    }
    for (_, templates, topics) in FOREIGN {
        for (_, t) in topics.iter().enumerate().filter(|(i, _)| keep(*i)) {
            for tmpl in *templates {
                out.push(tmpl.replace("{t}", t));
            }
        }
    }
    for (_, sentence) in SENTENCES.iter().enumerate().filter(|(i, _)| keep(*i)) {
        for lang in TRANSLATE_LANGS {
            out.push(format!("Translate into {lang}: \"{sentence}\""));
        }
    }
    out
}

/// `n` prompts of `split` (fewer if the split has fewer), deterministic in `seed`. The list is
/// shuffled so any prefix mixes every kind of prompt.
pub fn prompts(split: Split, n: usize, seed: u64) -> Vec<String> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ if split == Split::Train { 0x0074_7261_696E } else { 0x6865_6C64 });
    let mut all = candidates(split, &mut rng);
    all.sort();
    all.dedup();
    all.shuffle(&mut rng);
    all.truncate(n);
    all
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_are_disjoint_deterministic_and_varied() {
        let train = prompts(Split::Train, usize::MAX, 1);
        let held = prompts(Split::HeldOut, usize::MAX, 1);
        assert!(train.len() >= 1000, "only {} training prompts", train.len());
        assert!(held.len() >= 150, "only {} held-out prompts", held.len());
        assert!(held.iter().all(|p| !train.contains(p)));
        assert_eq!(prompts(Split::Train, 50, 1), prompts(Split::Train, 50, 1));
        assert_ne!(prompts(Split::Train, 50, 1), prompts(Split::Train, 50, 2));
        let first = &train[..200];
        assert!(first.iter().any(|p| p.contains("function")) && first.iter().any(|p| p.contains("Explique") || p.contains("Explica") || p.contains("Erkläre")));
    }
}
