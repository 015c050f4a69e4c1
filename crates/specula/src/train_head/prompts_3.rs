//! The third prompt pool (added for the fused-feature heads): topics the first two pools lack
//! (sciences, history, geography, cooking, health, travel, work, money, technology, nature,
//! everyday advice, creative writing forms, editing tasks, SQL/shell/web code, word problems,
//! more languages). Each group is templates x topics; as in the first pools, every fifth topic of
//! a group (index 4, 9, ...) is held out, so held-out prompts never share a subject with training.

use rand::Rng;
use rand_chacha::ChaCha8Rng;
use super::prompts::{split_of, Split};

/// (templates with `{t}`, topics).
type Group = (&'static [&'static str], &'static [&'static str]);

const GROUPS: &[Group] = &[
    (
        &["What is {t}?", "Explain {t} in three sentences.", "Why does {t} matter? Keep it short.", "Give a simple example of {t}.", "What do scientists know about {t}?"],
        &[
            "the periodic table", "an atom", "a chemical reaction", "friction", "sound waves", "the boiling point of water", "erosion", "a food chain", "the nervous system",
            "plate tectonics", "cell division", "the ozone layer", "static electricity", "a lunar eclipse", "pollination", "the speed of sound", "acid rain", "a comet",
            "the human skeleton", "condensation", "a magnet", "the digestive system", "migration of birds", "the Big Bang", "ocean currents", "gravity on the Moon",
            "a rainbow's colours", "fossils", "the circulatory system", "genetics",
        ],
    ),
    (
        &["Tell me about {t}.", "Summarize {t} in a short paragraph.", "What caused {t}, and what were its effects?", "Give three key facts about {t}."],
        &[
            "the ancient Egyptians", "the Middle Ages", "the invention of the telephone", "the first Moon landing", "the Silk Road", "the Vikings", "the Cold War",
            "the fall of the Berlin Wall", "the ancient Greeks", "the Aztec Empire", "the age of exploration", "the history of aviation", "the Ottoman Empire",
            "the abolition of slavery", "the history of the bicycle", "the Great Depression", "the invention of paper", "the history of chess", "medieval castles",
            "the first computers", "the history of the Olympic marathon", "the Mongol Empire", "the building of the pyramids", "women's right to vote",
            "the history of coffee",
        ],
    ),
    (
        &["Describe {t}.", "What is special about {t}?", "What should a visitor know about {t}?", "Write a short travel guide to {t}."],
        &[
            "the Amazon rainforest", "the Sahara desert", "Japan", "the Alps", "Iceland", "the Nile river", "New York City", "the Great Barrier Reef", "Canada",
            "the city of Rome", "Mount Everest", "Norway's fjords", "the Grand Canyon", "Australia", "the Mediterranean Sea", "Kenya", "the city of Barcelona",
            "Antarctica", "India", "the Andes", "Lisbon", "Mexico City", "the Scottish Highlands", "Vietnam", "the Netherlands",
        ],
    ),
    (
        &["Give me a simple recipe for {t}.", "How do I cook {t}?", "What ingredients do I need for {t}?", "Suggest a healthy version of {t}."],
        &[
            "pancakes", "vegetable soup", "a tomato pasta sauce", "an omelette", "banana bread", "a green salad", "chicken curry", "lentil stew", "fried rice",
            "guacamole", "a fruit smoothie", "roasted vegetables", "homemade pizza", "chocolate chip cookies", "a simple risotto", "hummus", "French toast",
            "a potato gratin", "apple crumble", "a bean chili", "overnight oats", "a vegetable stir-fry", "lemonade", "mashed potatoes", "a tuna sandwich",
        ],
    ),
    (
        &["What are good ways to deal with {t}?", "I am struggling with {t}. Any advice?", "Give me practical tips for {t}.", "What causes {t}, and how can it be improved?"],
        &[
            "procrastination", "a noisy neighbour", "feeling tired in the afternoon", "a disagreement with a friend", "nervousness before an exam",
            "too much screen time", "a messy desk", "losing motivation to exercise", "a long commute", "staying focused while studying", "moving to a new city",
            "a difficult coworker", "forgetting names", "spending too much money", "back pain from sitting", "a fear of flying", "waking up early",
            "keeping a plant alive", "learning to say no", "loneliness", "managing a busy week", "starting a new job", "writer's block", "homesickness",
            "a slow computer",
        ],
    ),
    (
        &["Write a limerick about {t}.", "Write a four-line rhyming poem about {t}.", "Write song lyrics about {t}.", "Write a fable about {t} with a moral.", "Write a short scene for a play about {t}.", "Write a one-paragraph mystery about {t}."],
        &[
            "a forgetful wizard", "a penguin in the desert", "a talking teapot", "the first snow of the year", "a pirate who is afraid of water",
            "a bee and a flower", "a lost umbrella", "a knight and a tiny dragon", "a spaceship that runs out of fuel", "a mouse in a museum",
            "a lighthouse in a storm", "an owl who cannot sleep", "a train that never stops", "a garden gnome", "the wind and the sun",
            "a stolen painting", "a clever crow", "an empty theatre", "a sleepy bear", "a paper boat",
        ],
    ),
    (
        &["Rewrite this sentence in a formal style: \"{t}\"", "Fix the grammar: \"{t}\"", "Make this sentence more polite: \"{t}\"", "Say this in simpler words: \"{t}\"", "Turn this into a question: \"{t}\""],
        &[
            "me and him goes to the store yesterday", "send me the report now", "the results was not what we expected", "I can't come, I'm busy",
            "this product are really good and cheap", "we gonna finish it tomorrow maybe", "give back my book", "the meeting got cancelled because nobody came",
            "there is many reasons to learn coding", "your order has been shipped and will arrive soon", "i dont know where is the library",
            "the team worked hard and they wins the game", "turn down the music", "she don't like coffee in the morning", "we need to talk about the budget",
            "the software update fixed several bugs", "he have been waiting for an hour", "tell me the answer", "the city council approved the new park",
            "they was happy with the results",
        ],
    ),
    (
        &["Write a SQL query that {t}.", "Show how to {t} with a SQL query, and explain it."],
        &[
            "lists all customers from a table called customers", "counts the orders per customer", "finds the five most expensive products",
            "returns employees hired after 2020", "computes the average salary per department", "deletes duplicate rows from a table",
            "joins an orders table with a customers table", "finds customers who have never placed an order", "updates the price of a product",
            "selects the second highest salary",
        ],
    ),
    (
        &["Write a shell command that {t}.", "How do I {t} from the Linux command line?"],
        &[
            "counts the lines of a file", "finds all .txt files in a folder", "shows the disk usage of a directory", "searches for a word in many files",
            "renames every .jpeg file to .jpg", "prints the ten largest files", "shows which process uses a port", "compresses a folder into a tar.gz archive",
            "replaces a word in a file", "lists the most recently changed files",
        ],
    ),
    (
        &["Write HTML and CSS for {t}.", "How do I make {t} with HTML and CSS?"],
        &[
            "a centered login form", "a navigation bar", "a simple photo gallery", "a button that changes colour on hover", "a two-column page layout",
            "a pricing table", "a contact form", "a card with an image and a title", "a footer with links", "a responsive header",
        ],
    ),
    (
        &["Write a {t} in Python and explain how it works.", "Write a {t} in JavaScript.", "What is the simplest way to write a {t}?"],
        &[
            "class for a bank account", "function that checks a password's strength", "program that guesses a number", "to-do list in the terminal",
            "function that converts minutes to hours and minutes", "unit test for a function that adds two numbers", "function that reads a CSV file",
            "simple calculator", "function that counts characters in a string", "program that prints a multiplication table", "function that shuffles a list",
            "timer that counts down from ten", "function that finds the longest word in a sentence", "linked list", "function that checks if a number is even",
        ],
    ),
    (
        &["{t} Explain your reasoning step by step.", "{t}"],
        &[
            "A box holds 12 eggs. How many boxes are needed for 150 eggs?", "Tom is 3 times as old as his son, who is 11. How old is Tom?",
            "A pizza is cut into 8 slices and 3 people eat 2 slices each. How many slices are left?", "What is 15% of 80?",
            "A car uses 6 liters of fuel per 100 km. How much fuel does it need for 250 km?", "If a book costs 12 euros after a 20% discount, what was the price before?",
            "How many minutes are there in a week?", "A garden is 9 m by 6 m. How much fence is needed to go around it?", "What is the average of 4, 8, 15 and 21?",
            "A recipe needs 250 g of flour for 10 cookies. How much flour for 24 cookies?", "Convert 5 kilometers to miles.", "What is 2 to the power of 10?",
            "A worker earns 18 dollars an hour. How much does she earn in a 37-hour week?", "How many seconds are in three hours?",
            "Three friends share 47 dollars equally. How much does each get?", "What is the next number in the sequence 2, 6, 12, 20, 30?",
            "A tank fills at 4 liters per minute. How long to fill 90 liters?", "Is 221 a prime number?", "What is one third of 3.6?",
            "A shirt costs 25 dollars and is taxed at 8%. What is the total?",
        ],
    ),
    (
        &["Explain the difference between {t}.", "People often confuse {t}. How are they different?"],
        &[
            "weather and climate", "a virus and a bacterium", "speed and velocity", "RAM and storage", "a simile and a metaphor", "mass and weight",
            "an alligator and a crocodile", "affect and effect", "a debit card and a credit card", "empathy and sympathy", "a lake and a pond",
            "HTTP and HTTPS", "a comet and an asteroid", "baking soda and baking powder", "a republic and a democracy",
        ],
    ),
    (
        &["Write a product description for {t}.", "Write a short advertisement for {t}.", "Write a review of {t}."],
        &[
            "a reusable water bottle", "a pair of running shoes", "a small coffee shop", "a language learning app", "a wooden desk", "noise-cancelling headphones",
            "a city bike", "a board game for children", "a new science museum", "a vegetarian restaurant", "a backpack for hiking", "a smart watch",
            "a handmade candle", "a cooking class", "a mystery novel",
        ],
    ),
    (
        &["Write a short speech for {t}.", "Write an invitation for {t}.", "Write a thank-you note for {t}."],
        &[
            "a friend's wedding", "a school graduation", "a colleague's retirement", "a charity fundraiser", "the opening of a library", "a team that won a match",
            "a neighbourhood clean-up day", "a grandparent's birthday", "a volunteer group", "the end of a project",
        ],
    ),
    (
        &["What are the pros and cons of {t}?", "Should I choose {t}? Help me decide.", "What should I consider before {t}?"],
        &[
            "working part-time", "buying a used phone", "studying abroad", "getting a dog", "living without a car", "learning two languages at once",
            "starting a small business", "taking a gap year", "switching careers", "moving to the countryside", "using a tablet for school",
            "cooking every day instead of eating out", "joining a gym", "renting out a spare room", "going vegetarian",
        ],
    ),
    (
        &["Describe the life of {t}.", "Write three surprising facts about {t}.", "How does {t} survive in the wild?"],
        &[
            "an octopus", "an elephant", "a honeybee", "a polar bear", "a hummingbird", "a sea turtle", "a wolf", "an ant colony", "a koala", "a dolphin",
            "a chameleon", "an eagle", "a giraffe", "a salmon", "a bat",
        ],
    ),
    (
        &["Résume {t} en quelques lignes.", "Pourquoi {t} est-il important ?", "Raconte une courte histoire sur {t}."],
        &["le recyclage", "un voyage en bateau", "la photographie", "le petit déjeuner", "les abeilles", "la neige", "un musée", "la radio", "le marché", "la pluie"],
    ),
    (
        &["Resume {t} en pocas líneas.", "¿Por qué es importante {t}?", "Cuenta una historia breve sobre {t}."],
        &["el reciclaje", "un viaje en barco", "la fotografía", "el desayuno", "las abejas", "la nieve", "un museo", "la radio", "el mercado", "la luna"],
    ),
    (
        &["Fasse {t} in wenigen Sätzen zusammen.", "Warum ist {t} wichtig?", "Erzähle eine kurze Geschichte über {t}."],
        &["das Recycling", "eine Schiffsreise", "die Fotografie", "das Frühstück", "die Bienen", "den Schnee", "ein Museum", "das Radio", "den Markt", "den Regen"],
    ),
    (
        &["Riassumi {t} in poche righe.", "Perché {t} è importante?", "Racconta una breve storia su {t}."],
        &["il riciclo", "un viaggio in nave", "la fotografia", "la colazione", "le api", "la neve", "un museo", "la radio", "il mercato", "la pioggia"],
    ),
    (
        &["Resuma {t} em poucas linhas.", "Por que {t} é importante?", "Conte uma pequena história sobre {t}."],
        &["a reciclagem", "uma viagem de barco", "a fotografia", "o café da manhã", "as abelhas", "a neve", "um museu", "o rádio", "o mercado", "a lua"],
    ),
    (
        &["Leg {t} uit in eenvoudige woorden.", "Schrijf een kort verhaal over {t}."],
        &["de fiets", "de zee", "het weer", "de school", "de muziek", "het bos", "de stad", "de winter", "de familie", "het eten"],
    ),
];

/// Numbers drawn per template for the arithmetic group (the templates carry `{a}`, `{b}`, `{c}`).
const MATH_TEMPLATES_3: &[&str] = &[
    "A bakery sells {a} loaves a day. How many loaves does it sell in {b} days?",
    "What is {c} divided by {a}? Give the quotient and the remainder.",
    "A class has {a} students and {b} of them are absent. What fraction is present?",
    "If a runner covers {a} km every day, how far does she run in {b} weeks?",
    "Round {c}.{a} to the nearest whole number and explain the rule.",
    "A cinema ticket costs {a} dollars. How much do {b} tickets cost with a 10% group discount?",
    "Write {c} in binary.",
    "What is the least common multiple of {a} and {b}?",
    "A square has a perimeter of {c} cm. What is its area?",
    "Sam saves {a} dollars a week. How many weeks until he has {c} dollars?",
];

/// The third pool's prompts of one split.
pub(super) fn candidates_3(split: Split, rng: &mut ChaCha8Rng) -> Vec<String> {
    let keep = |i: usize| split_of(i) == split;
    let mut out = Vec::new();
    for (templates, topics) in GROUPS {
        for (_, t) in topics.iter().enumerate().filter(|(i, _)| keep(*i)) {
            for tmpl in *templates {
                out.push(tmpl.replace("{t}", t));
            }
        }
    }
    // the template index decides the split, as for the first pools' arithmetic
    for (_, tmpl) in MATH_TEMPLATES_3.iter().enumerate().filter(|(i, _)| keep(*i)) {
        for _ in 0..20 {
            let (a, b) = (rng.gen_range(3..70u32), rng.gen_range(2..30u32));
            let c = rng.gen_range(a + b..900);
            out.push(tmpl.replace("{a}", &a.to_string()).replace("{b}", &b.to_string()).replace("{c}", &c.to_string()));
        }
    }
    out
}
