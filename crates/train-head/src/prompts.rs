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
pub(super) fn split_of(topic_index: usize) -> Split {
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

const EMAIL_TEMPLATES: &[&str] = &["Write a polite email to {who} about {what}.", "Write a short message to {who} explaining {what}."];
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
        &[
            "le soleil",
            "la cuisine française",
            "les vacances d'été",
            "l'amitié",
            "la musique",
            "les voyages en train",
            "le sport",
            "la mer",
            "les livres",
            "le jardinage",
        ],
    ),
    (
        "es",
        &["Explica {t} en pocas palabras.", "Escribe un poema corto sobre {t}.", "Dame tres consejos sobre {t}."],
        &[
            "el café",
            "la familia",
            "el fútbol",
            "las montañas",
            "la lluvia",
            "el trabajo en equipo",
            "la comida sana",
            "los animales",
            "la ciudad",
            "el verano",
        ],
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

// Second pool (added for the second training run of the shipped head): more topics and templates,
// split by topic index the same way. Its prompts come after every prompt of the first pool, so
// the first pool's order (and every shard already written from it) is unchanged.
const CODE_TASKS_2: &[&str] = &[
    "converts a number to Roman numerals",
    "checks whether a year is a leap year",
    "finds the second largest number in a list",
    "counts the words in a string",
    "rotates a list by k positions",
    "converts a binary string to an integer",
    "finds the most common element of a list",
    "removes all whitespace from a string",
    "computes the power of a number without a library",
    "checks whether brackets in a string are balanced",
    "implements a queue with two stacks",
    "returns the prime factors of a number",
    "computes the median of a list",
    "splits a list into chunks of size n",
    "reverses the words of a sentence",
    "finds the intersection of two lists",
    "converts a string to title case",
    "computes the dot product of two vectors",
    "implements insertion sort",
    "checks whether a list is sorted",
];
const CODE_TEMPLATES_2: &[&str] = &[
    "How would you write a {lang} function that {task}? Add comments to the code.",
    "Give an example in {lang} of code that {task}, and describe its time complexity.",
];
const HOWTO_TASKS: &[&str] = &[
    "make a good cup of coffee",
    "plant tomatoes in a garden",
    "prepare for a job interview",
    "learn to play the guitar",
    "change a flat tire on a bicycle",
    "write a cover letter",
    "organize a small kitchen",
    "start running as a beginner",
    "make a budget for a month",
    "bake simple bread at home",
    "take better photos with a phone",
    "study for an exam",
    "train a puppy to sit",
    "clean a laptop keyboard",
    "plan a weekend trip",
    "make friends in a new city",
    "cook rice on the stove",
    "give a good presentation",
    "fall asleep faster",
    "keep a journal",
];
const HOWTO_TEMPLATES: &[&str] =
    &["How do I {t}?", "Give me step-by-step instructions to {t}.", "What is the best way to {t}? Keep it short.", "I want to {t}. Where should I start?"];
const LIST_THINGS_2: &[&str] = &[
    "ways to improve your memory",
    "vegetables that grow well in small gardens",
    "famous paintings and who painted them",
    "tips for a long flight",
    "hobbies you can start at home",
    "ways to reduce plastic waste",
    "snacks for a road trip",
    "skills every student should learn",
    "tips for taking care of a cat",
    "ideas for a birthday present",
    "signs of a healthy lifestyle",
    "inventions that changed the world",
    "ways to make a small room look bigger",
    "tips for public speaking",
    "good habits for the morning",
    "dishes you can cook in 15 minutes",
    "countries in Europe and their capitals",
    "ways to stay warm in winter",
    "reasons to learn history",
    "tips for working from home",
];
const LIST_TEMPLATES_2: &[&str] = &["Name {n} {thing} and explain each briefly.", "Can you suggest {n} {thing}?"];
const PROSE_SUBJECTS_2: &[&str] = &[
    "a clockmaker who can stop time",
    "a girl who talks to birds",
    "a ship lost in the fog",
    "a small café on a busy street",
    "an old man and his garden",
    "a robot that wants a friend",
    "a snowy night in the mountains",
    "a detective solving a simple mystery",
    "a boy who finds a map in the attic",
    "the last day of summer",
    "a painter who only paints the sea",
    "a desert at noon",
    "a family road trip",
    "a fox in the city",
    "a violin found in a shop window",
    "two strangers on a bus",
    "a village festival",
    "a letter that arrives fifty years late",
    "a teacher's last lesson",
    "a river that changes its course",
];
const PROSE_TEMPLATES_2: &[&str] = &["Write a dialogue about {s}.", "Write a very short fairy tale about {s}.", "Write a diary entry about {s}."];
const CONCEPTS_2: &[&str] = &[
    "evolution",
    "the solar system",
    "artificial intelligence",
    "the greenhouse effect",
    "nuclear energy",
    "the human heart",
    "taxes",
    "the printing press",
    "bacteria",
    "the Industrial Revolution",
    "magnetism",
    "the internet of things",
    "rainbows",
    "the Olympic Games",
    "antibiotics",
    "tides",
    "the Renaissance",
    "cloud computing",
    "the speed of light",
    "interest rates",
    "the Great Wall of China",
    "batteries",
    "photosynthesis in the ocean",
    "memory in the brain",
    "encryption",
];
const CONCEPT_TEMPLATES_2: &[&str] = &[
    "Why is {c} important?",
    "Give three interesting facts about {c}.",
    "How does {c} work? Answer in a few sentences.",
    "What would a beginner need to know about {c}?",
];
const COMPARE_PAIRS: &[&str] = &[
    "cats and dogs as pets",
    "trains and planes for travel",
    "tea and coffee",
    "Python and JavaScript",
    "city life and country life",
    "reading books and watching films",
    "summer and winter",
    "renting and buying a home",
    "paper books and e-books",
    "running and swimming",
    "working alone and working in a team",
    "electric cars and petrol cars",
    "learning online and in a classroom",
    "the sun and the moon",
    "oceans and lakes",
];
const COMPARE_TEMPLATES: &[&str] = &["Compare {p}.", "What are the differences between {p}?", "Which is better: {p}? Give both sides."];
const FOREIGN_2: &[(&str, &[&str], &[&str])] = &[
    (
        "fr",
        &["Qu'est-ce que {t} ? Réponds simplement.", "Écris une petite histoire sur {t}."],
        &["la ville de Paris", "l'hiver", "les animaux de la ferme", "le chocolat", "la lecture", "la montagne", "l'école", "le cinéma", "la forêt", "le vélo"],
    ),
    (
        "es",
        &["¿Qué es {t}? Responde brevemente.", "Escribe una historia corta sobre {t}."],
        &["el mar", "la música latina", "la escuela", "el invierno", "los libros", "el cine", "la amistad", "el tren", "la playa", "las flores"],
    ),
    (
        "de",
        &["Was ist {t}? Antworte kurz.", "Schreibe eine kurze Geschichte über {t}."],
        &["den Sommer", "die Musik", "das Meer", "die Schule", "den Sport", "das Brot", "die Berge", "das Fahrrad", "die Familie", "den Garten"],
    ),
];
const SENTENCES_2: &[&str] = &[
    "I will call you tomorrow morning.",
    "The restaurant is closed on Sundays.",
    "We need more milk and bread.",
    "My favourite colour is blue.",
    "The bus is late again.",
    "He is reading a book about history.",
    "It is raining in the city.",
    "They live near the old bridge.",
    "I forgot my umbrella at home.",
    "The concert starts at eight.",
];

/// The second pool's prompts of one split.
fn candidates_2(split: Split, rng: &mut ChaCha8Rng) -> Vec<String> {
    let mut out = Vec::new();
    let keep = |i: usize| split_of(i) == split;
    for (i, task) in CODE_TASKS_2.iter().enumerate().filter(|(i, _)| keep(*i)) {
        for (j, tmpl) in CODE_TEMPLATES.iter().chain(CODE_TEMPLATES_2).enumerate() {
            for lang in CODE_LANGS.iter().skip((i + j) % 3).step_by(3) {
                out.push(tmpl.replace("{lang}", lang).replace("{task}", task));
            }
        }
    }
    for (i, task) in CODE_TASKS.iter().enumerate().filter(|(i, _)| keep(*i)) {
        for (j, tmpl) in CODE_TEMPLATES_2.iter().enumerate() {
            for lang in CODE_LANGS.iter().skip((i + j) % 2).step_by(2) {
                out.push(tmpl.replace("{lang}", lang).replace("{task}", task));
            }
        }
    }
    for (_, t) in HOWTO_TASKS.iter().enumerate().filter(|(i, _)| keep(*i)) {
        for tmpl in HOWTO_TEMPLATES {
            out.push(tmpl.replace("{t}", t));
        }
    }
    // maths: new numbers for the same templates (the template index decides the split, as above)
    for (_, tmpl) in MATH_TEMPLATES.iter().enumerate().filter(|(i, _)| keep(*i)) {
        for _ in 0..15 {
            let (a, b) = (rng.gen_range(2..90u32), rng.gen_range(2..50u32));
            let c = rng.gen_range(a + b..600);
            let sq = [16u32, 25, 36, 49, 64, 81, 100, 121, 144, 169, 196, 225][rng.gen_range(0..12)];
            out.push(tmpl.replace("{a}", &a.to_string()).replace("{b}", &b.to_string()).replace("{c}", &c.to_string()).replace("{sq}", &sq.to_string()));
        }
    }
    for (_, thing) in LIST_THINGS_2.iter().enumerate().filter(|(i, _)| keep(*i)) {
        for tmpl in LIST_TEMPLATES.iter().chain(LIST_TEMPLATES_2) {
            for n in [3, 5, 8] {
                out.push(tmpl.replace("{n}", &n.to_string()).replace("{thing}", thing));
            }
        }
    }
    for (_, thing) in LIST_THINGS.iter().enumerate().filter(|(i, _)| keep(*i)) {
        for tmpl in LIST_TEMPLATES_2 {
            for n in [4, 6] {
                out.push(tmpl.replace("{n}", &n.to_string()).replace("{thing}", thing));
            }
        }
    }
    for (_, s) in PROSE_SUBJECTS_2.iter().enumerate().filter(|(i, _)| keep(*i)) {
        for tmpl in PROSE_TEMPLATES.iter().chain(PROSE_TEMPLATES_2) {
            out.push(tmpl.replace("{s}", s));
        }
    }
    for (_, s) in PROSE_SUBJECTS.iter().enumerate().filter(|(i, _)| keep(*i)) {
        for tmpl in PROSE_TEMPLATES_2 {
            out.push(tmpl.replace("{s}", s));
        }
    }
    for (_, c) in CONCEPTS_2.iter().enumerate().filter(|(i, _)| keep(*i)) {
        for tmpl in CONCEPT_TEMPLATES.iter().chain(CONCEPT_TEMPLATES_2) {
            out.push(tmpl.replace("{c}", c));
        }
    }
    for (_, c) in CONCEPTS.iter().enumerate().filter(|(i, _)| keep(*i)) {
        for tmpl in CONCEPT_TEMPLATES_2 {
            out.push(tmpl.replace("{c}", c));
        }
    }
    for (_, p) in COMPARE_PAIRS.iter().enumerate().filter(|(i, _)| keep(*i)) {
        for tmpl in COMPARE_TEMPLATES {
            out.push(tmpl.replace("{p}", p));
        }
    }
    for (_, templates, topics) in FOREIGN_2 {
        for (_, t) in topics.iter().enumerate().filter(|(i, _)| keep(*i)) {
            for tmpl in *templates {
                out.push(tmpl.replace("{t}", t));
            }
        }
    }
    for (_, sentence) in SENTENCES_2.iter().enumerate().filter(|(i, _)| keep(*i)) {
        for lang in TRANSLATE_LANGS {
            out.push(format!("Translate into {lang}: \"{sentence}\""));
        }
    }
    out
}

/// `n` prompts of `split` (fewer if the split has fewer), deterministic in `seed`. The first
/// pool comes first, shuffled so any prefix mixes every kind of prompt, then the second pool and
/// the third (`prompts_3`; each shuffled the same way, without prompts an earlier pool already
/// has): a larger `n` only appends prompts, so the shards of a smaller run stay valid.
pub fn prompts(split: Split, n: usize, seed: u64) -> Vec<String> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ if split == Split::Train { 0x0074_7261_696E } else { 0x6865_6C64 });
    let mut all = candidates(split, &mut rng);
    all.sort();
    all.dedup();
    all.shuffle(&mut rng);
    // later pools, each shuffled with a stream of its own, without prompts already taken
    type Pool = fn(Split, &mut ChaCha8Rng) -> Vec<String>;
    let later: [(Pool, u64, u64); 2] = [(candidates_2, 0x0074_7261_6932, 0x6865_6C32), (crate::prompts_3::candidates_3, 0x0074_7261_6933, 0x6865_6C33)];
    for (pool, train_key, held_key) in later {
        if all.len() >= n {
            break;
        }
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ if split == Split::Train { train_key } else { held_key });
        let mut more = pool(split, &mut rng);
        more.sort();
        more.dedup();
        let seen: std::collections::HashSet<&String> = all.iter().collect();
        more.retain(|p| !seen.contains(p));
        more.shuffle(&mut rng);
        all.extend(more);
    }
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
        assert!(train.len() >= 3200, "only {} training prompts", train.len());
        assert!(held.len() >= 300, "only {} held-out prompts", held.len());
        let train_set: std::collections::HashSet<&String> = train.iter().collect();
        assert_eq!(train_set.len(), train.len(), "duplicate training prompts");
        assert!(held.iter().all(|p| !train_set.contains(p)));
        assert_eq!(prompts(Split::Train, 50, 1), prompts(Split::Train, 50, 1));
        assert_ne!(prompts(Split::Train, 50, 1), prompts(Split::Train, 50, 2));
        let first = &train[..200];
        assert!(first.iter().any(|p| p.contains("function")) && first.iter().any(|p| p.contains("Explique") || p.contains("Explica") || p.contains("Erkläre")));
    }

    #[test]
    fn a_larger_count_only_appends_prompts() {
        let all = prompts(Split::Train, usize::MAX, 1);
        for n in [448, 1000, 1500, 2048, 2500] {
            assert_eq!(prompts(Split::Train, n, 1)[..], all[..n]);
        }
    }

    /// The shipped head's data was made from the first 2048 training prompts: a pool added later
    /// must leave them as they are (sha256 of the prompts joined by newlines).
    #[test]
    fn the_first_2048_training_prompts_stay_those_the_shipped_data_used() {
        use sha2::Digest;
        let p = prompts(Split::Train, 2048, 1);
        let hash: String = sha2::Sha256::digest(p.join("\n").as_bytes()).iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hash, "4a4e2a42359cb26c940492b8c6b51c917ede76d9e1a0c36f60e2b8f5b05a912d");
    }

    #[test]
    fn the_shipped_heldout_prompts_are_the_first_64_of_the_heldout_split() {
        // heads/heldout-prompts.txt was written by `specula-train-head data --num-heldout 64 --seed 1`
        // before the second pool existed: the held-out figures must stay comparable
        let file = include_str!("../../../heads/heldout-prompts.txt");
        let shipped: Vec<&str> = file.lines().collect();
        assert_eq!(shipped.len(), 64);
        assert_eq!(prompts(Split::HeldOut, 64, 1), shipped);
    }
}
