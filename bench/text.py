"""Seeded filler text for prompts, sized in tokens by server-agnostic estimates.

The client does not load the server's tokenizer. Filler text is common English words, each
counted as one token (a common word after a space is one token in the usual byte-level BPE
vocabularies: 1,000 random :data:`WORDS` are exactly 1,000 tokens under SmolLM2's tokenizer).
Other text (source code) is sized by characters (:data:`CHARS_PER_TOKEN`). The estimates only
size prompts; what a report counts is the server's ``usage.prompt_tokens``.
"""

from __future__ import annotations

import random

CHARS_PER_TOKEN = 4.0
"""Characters per token assumed when sizing text other than :data:`WORDS` (the usual rule of
thumb; Python standard-library source measures 3.7-4.3 under SmolLM2's tokenizer)."""

_WORD_TEXT = """
able about above across action active actually add address after again against age agree air
allow almost alone along already also always among amount analysis animal another answer any
anyone appear apply approach area argue around arrive article artist assume attack attention
author available avoid away baby back bad bank base beat beautiful because become before begin
behavior behind believe benefit best better between beyond big bill billion bit black blood
blue board body book born both box boy break bring brother budget build building business
call camera campaign cancer candidate capital car card care career carry case catch cause cell
center central century certain chair challenge chance change character charge check child
choice choose church citizen city civil claim class clear close coach cold collection college
color come common community company compare computer concern condition conference consider
contain continue control cost could country couple course court cover create crime cultural
culture current customer cut dark data daughter day dead deal death debate decade decide
decision deep defense degree describe design despite detail determine develop difference
different difficult dinner direction director discover discuss disease doctor door down draw
dream drive drop during early east easy economic economy edge education effect effort eight
either election else employee end energy enjoy enough enter entire environment especially
establish even evening event ever every evidence exactly example executive exist expect
experience expert explain eye face fact factor fail fall family far fast father fear federal
feel feeling few field fight figure fill film final finally financial find fine finger finish
fire firm first fish five floor fly focus follow food foot force foreign forget form former
forward four free friend front full fund future game garden gas general generation girl give
glass goal good government great green ground group grow growth guess gun guy hair half hand
hang happen happy hard have head health hear heart heat heavy help here herself high himself
history hold home hope hospital hot hotel hour house however huge human hundred husband idea
identify image imagine impact important improve include including increase indeed indicate
individual industry information inside instead institution interest interesting international
interview into investment involve issue item itself job join just keep key kid kill kind
kitchen know knowledge land language large last late later laugh law lawyer lay lead leader
learn least leave left leg legal less letter level life light like likely line list listen
little live local long look lose loss love low machine magazine main maintain major majority
make manage management manager many market marriage material matter maybe mean measure media
medical meet meeting member memory mention message method middle might military million mind
minute miss mission model modern moment money month more morning most mother mouth move
movement movie much music must myself name nation national natural nature near nearly
necessary need network never news newspaper next nice night none north note nothing notice
number occur offer office officer official often once only onto open operation opportunity
option order organization other others outside over own owner page pain painting paper parent
part participant particular partner party pass past patient pattern pay peace people per
perform performance perhaps period person personal phone physical pick picture piece place
plan plant play player point police policy political poor popular population position
positive possible power practice prepare present president pressure pretty prevent price
private probably problem process produce product production professional professor program
project property protect prove provide public pull purpose push quality question quickly
quite race radio raise range rate rather reach read ready real reality realize really reason
receive recent recently recognize record red reduce reflect region relate relationship
religious remain remember remove report represent require research resource respond response
rest result return reveal rich right rise risk road rock role room rule run safe same save
say scene school science scientist score sea season seat second section security see seek
seem sell send senior sense series serious serve service set seven several shake share shoot
short shot should shoulder show side sign significant similar simple simply since sing single
sister sit site situation size skill skin small smile social society soldier some somebody
someone something sometimes son song soon sort sound source south southern space speak
special specific speech spend sport spring staff stage stand standard star start state
statement station stay step still stock stop store story strategy street strong structure
student study stuff style subject success successful such suddenly suffer suggest summer
support sure surface system table take talk task tax teach teacher team technology television
tell ten tend term test than thank that their them themselves then theory there these they
thing think third this those though thought thousand threat three through throughout throw
thus time today together tonight too top total tough toward town trade traditional training
travel treat treatment tree trial trip trouble true truth try turn type under understand unit
until upon use usually value various very victim view violence visit voice vote wait walk wall
want war watch water way weapon wear week weight well west western what whatever when where
whether which while white whole whom whose why wide wife will win wind window wish with
within without woman wonder word work worker world worry would write writer wrong yard yeah
year yes yet young yourself
"""

WORDS = tuple(_WORD_TEXT.split())
"""Common English words, each one token (after a space) in the usual BPE vocabularies."""


def estimate_tokens(text: str, chars_per_token: float = CHARS_PER_TOKEN) -> int:
    """Estimated token count of ``text`` by characters (at least 1 for non-empty text)."""
    return max(1, round(len(text) / chars_per_token)) if text else 0


def random_words(rng: random.Random, tokens: int) -> str:
    """``tokens`` words drawn from :data:`WORDS`, joined by spaces (about ``tokens`` tokens).

    Args:
        rng: the source of randomness (seeded by the caller, so runs repeat).
        tokens: the length in words; 0 gives an empty string.
    """
    return " ".join(rng.choice(WORDS) for _ in range(tokens))
