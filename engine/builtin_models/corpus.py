"""Built-in English text for training the byte-level BPE tokenizer of random checkpoints.

Public-domain passages (U.S. founding documents, nineteenth-century novels, the King James
Bible) plus a little plain prose about computing, so the tokenizer learns common English words
and the byte-level alphabet covers any UTF-8 input.
"""

PASSAGES = (
    """Four score and seven years ago our fathers brought forth on this continent, a new nation,
conceived in Liberty, and dedicated to the proposition that all men are created equal.
Now we are engaged in a great civil war, testing whether that nation, or any nation so
conceived and so dedicated, can long endure. We are met on a great battle-field of that war.
We have come to dedicate a portion of that field, as a final resting place for those who here
gave their lives that that nation might live. It is altogether fitting and proper that we
should do this. But, in a larger sense, we can not dedicate -- we can not consecrate -- we can
not hallow -- this ground. The brave men, living and dead, who struggled here, have consecrated
it, far above our poor power to add or detract. The world will little note, nor long remember
what we say here, but it can never forget what they did here. It is for us the living, rather,
to be dedicated here to the unfinished work which they who fought here have thus far so nobly
advanced. It is rather for us to be here dedicated to the great task remaining before us --
that from these honored dead we take increased devotion to that cause for which they gave the
last full measure of devotion -- that we here highly resolve that these dead shall not have
died in vain -- that this nation, under God, shall have a new birth of freedom -- and that
government of the people, by the people, for the people, shall not perish from the earth.""",
    """When in the Course of human events, it becomes necessary for one people to dissolve the
political bands which have connected them with another, and to assume among the powers of the
earth, the separate and equal station to which the Laws of Nature and of Nature's God entitle
them, a decent respect to the opinions of mankind requires that they should declare the causes
which impel them to the separation. We hold these truths to be self-evident, that all men are
created equal, that they are endowed by their Creator with certain unalienable Rights, that
among these are Life, Liberty and the pursuit of Happiness. That to secure these rights,
Governments are instituted among Men, deriving their just powers from the consent of the
governed, That whenever any Form of Government becomes destructive of these ends, it is the
Right of the People to alter or to abolish it, and to institute new Government, laying its
foundation on such principles and organizing its powers in such form, as to them shall seem
most likely to effect their Safety and Happiness. Prudence, indeed, will dictate that
Governments long established should not be changed for light and transient causes; and
accordingly all experience hath shewn, that mankind are more disposed to suffer, while evils
are sufferable, than to right themselves by abolishing the forms to which they are accustomed.""",
    """We the People of the United States, in Order to form a more perfect Union, establish
Justice, insure domestic Tranquility, provide for the common defence, promote the general
Welfare, and secure the Blessings of Liberty to ourselves and our Posterity, do ordain and
establish this Constitution for the United States of America.""",
    """It is a truth universally acknowledged, that a single man in possession of a good fortune,
must be in want of a wife. However little known the feelings or views of such a man may be on
his first entering a neighbourhood, this truth is so well fixed in the minds of the surrounding
families, that he is considered the rightful property of some one or other of their daughters.
"My dear Mr. Bennet," said his lady to him one day, "have you heard that Netherfield Park is
let at last?" Mr. Bennet replied that he had not. "But it is," returned she; "for Mrs. Long
has just been here, and she told me all about it." Mr. Bennet made no answer. "Do you not want
to know who has taken it?" cried his wife impatiently. "You want to tell me, and I have no
objection to hearing it." This was invitation enough. "Why, my dear, you must know, Mrs. Long
says that Netherfield is taken by a young man of large fortune from the north of England; that
he came down on Monday in a chaise and four to see the place, and was so much delighted with
it, that he agreed with Mr. Morris immediately; that he is to take possession before
Michaelmas, and some of his servants are to be in the house by the end of next week."
"What is his name?" "Bingley." "Is he married or single?" "Oh! Single, my dear, to be sure! A
single man of large fortune; four or five thousand a year. What a fine thing for our girls!"
"How so? How can it affect them?" "My dear Mr. Bennet," replied his wife, "how can you be so
tiresome! You must know that I am thinking of his marrying one of them." "Is that his design
in settling here?" "Design! Nonsense, how can you talk so! But it is very likely that he may
fall in love with one of them, and therefore you must visit him as soon as he comes." """,
    """It was the best of times, it was the worst of times, it was the age of wisdom, it was the
age of foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the
season of Light, it was the season of Darkness, it was the spring of hope, it was the winter
of despair, we had everything before us, we had nothing before us, we were all going direct to
Heaven, we were all going direct the other way -- in short, the period was so far like the
present period, that some of its noisiest authorities insisted on its being received, for
good or for evil, in the superlative degree of comparison only.""",
    """Call me Ishmael. Some years ago -- never mind how long precisely -- having little or no
money in my purse, and nothing particular to interest me on shore, I thought I would sail about
a little and see the watery part of the world. It is a way I have of driving off the spleen and
regulating the circulation. Whenever I find myself growing grim about the mouth; whenever it is
a damp, drizzly November in my soul; whenever I find myself involuntarily pausing before coffin
warehouses, and bringing up the rear of every funeral I meet; and especially whenever my hypos
get such an upper hand of me, that it requires a strong moral principle to prevent me from
deliberately stepping into the street, and methodically knocking people's hats off -- then, I
account it high time to get to sea as soon as I can. This is my substitute for pistol and ball.
There now is your insular city of the Manhattoes, belted round by wharves as Indian isles by
coral reefs -- commerce surrounds it with her surf. Right and left, the streets take you
waterward. Its extreme downtown is the battery, where that noble mole is washed by waves, and
cooled by breezes, which a few hours previous were out of sight of land.""",
    """Alice was beginning to get very tired of sitting by her sister on the bank, and of having
nothing to do: once or twice she had peeped into the book her sister was reading, but it had no
pictures or conversations in it, "and what is the use of a book," thought Alice "without
pictures or conversations?" So she was considering in her own mind (as well as she could, for
the hot day made her feel very sleepy and stupid), whether the pleasure of making a
daisy-chain would be worth the trouble of getting up and picking the daisies, when suddenly a
White Rabbit with pink eyes ran close by her. There was nothing so very remarkable in that; nor
did Alice think it so very much out of the way to hear the Rabbit say to itself, "Oh dear! Oh
dear! I shall be late!" But when the Rabbit actually took a watch out of its waistcoat-pocket,
and looked at it, and then hurried on, Alice started to her feet, for it flashed across her
mind that she had never before seen a rabbit with either a waistcoat-pocket, or a watch to
take out of it, and burning with curiosity, she ran across the field after it, and fortunately
was just in time to see it pop down a large rabbit-hole under the hedge. In another moment down
went Alice after it, never once considering how in the world she was to get out again.""",
    """In the beginning God created the heaven and the earth. And the earth was without form, and
void; and darkness was upon the face of the deep. And the Spirit of God moved upon the face of
the waters. And God said, Let there be light: and there was light. And God saw the light, that
it was good: and God divided the light from the darkness. And God called the light Day, and the
darkness he called Night. And the evening and the morning were the first day. And God said, Let
there be a firmament in the midst of the waters, and let it divide the waters from the waters.
And God made the firmament, and divided the waters which were under the firmament from the
waters which were above the firmament: and it was so. And God called the firmament Heaven. And
the evening and the morning were the second day. And God said, Let the waters under the heaven
be gathered together unto one place, and let the dry land appear: and it was so. And God called
the dry land Earth; and the gathering together of the waters called he Seas: and God saw that
it was good. And God said, Let the earth bring forth grass, the herb yielding seed, and the
fruit tree yielding fruit after his kind, whose seed is in itself, upon the earth: and it was
so. And the earth brought forth grass, and herb yielding seed after his kind, and the tree
yielding fruit, whose seed was in itself, after his kind: and God saw that it was good.""",
    """Happy families are all alike; every unhappy family is unhappy in its own way. Everything
was in confusion in the Oblonskys' house. The wife had discovered that the husband was carrying
on an intrigue with a French girl, who had been a governess in their family, and she had
announced to her husband that she could not go on living in the same house with him.""",
    """A language model reads a sequence of tokens and predicts the next one. The server keeps the
keys and values of every token it has already seen in a cache, so that each new token only
needs one small step of work. Requests arrive at different times and have different lengths,
so the scheduler packs them into batches, splits long prompts into chunks, and frees memory
when a request finishes. The prefill stage processes the whole prompt at once; the decode stage
produces one token at a time for many requests together. When the two stages run on separate
machines, the cache blocks written during prefill must travel over the network to the decode
machine before the first generated token can be sampled. A router that remembers which blocks
each replica already holds can send a new request with a shared prefix to the replica that has
cached it, which saves both time and memory. Numbers such as 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10,
16, 32, 64, 128, 256, 512, 1024, 2048 and 4096 appear often in configuration files, as do
words like batch, block, token, request, latency, throughput, memory, server, client, model,
layer, head, weight, value, key, query, prompt, output, input, stream, error and timeout.""",
    """The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. How
vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow. What is the capital of
France? The capital of France is Paris. What is two plus two? Two plus two is four. Please
write a short poem about the sea. The sea is wide and grey and deep; it sings the sailors off
to sleep. Thank you! You are welcome. Hello, how are you today? I am fine, thank you for
asking. Can you help me with my homework? Of course, what do you need help with?""",
    """Café, naïve, façade, jalapeño, Zürich, São Paulo, Kraków, déjà vu, résumé, coöperate.
Grüße aus München. ¿Dónde está la biblioteca? Ça va très bien, merci. Привет, как дела?
Γειά σου κόσμε. 日本語のテキスト。中文文本。한국어 텍스트. Emoji: 🙂 🚀 ✨ ❤️ 👍.""",
)

TEXT = "\n\n".join(PASSAGES)
