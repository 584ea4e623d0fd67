"""Everyday English words for RULER's keys ("adjective-noun") and word lists (cwe).

RULER draws them from the `wonderwords` package's noun/adjective/verb lists; these are our own lists, written
in code so that examples need no extra package and stay identical across installs.
"""

from __future__ import annotations

from functools import cache

NOUNS = """
acorn actor admiral airplane album alley almond altar anchor ankle antelope anthem apartment apple apricot apron
aquarium arcade archer arena armchair army arrow artist asteroid athlete atlas attic auction aunt author avalanche
avenue avocado award axle baby backpack bacon badge badger bagel bakery balcony ballet balloon bamboo banana
bandage banjo banner barber barn barrel basket bathtub battery beach beacon beard beaver bedroom beetle bench berry
bicycle biscuit blanket blizzard blossom blouse boat bonnet book boot bottle boulder bouquet bracelet branch bread
breakfast brick bride bridge broccoli brother bucket buffalo building bullet bundle bunny butter butterfly button
cabbage cabin cabinet cable cactus cafe cake calendar camel camera campfire canal canary candle candy cannon canoe
canvas canyon captain caravan carpet carrot castle cathedral cattle cavern ceiling celery cellar cello cereal chair
chalk champion chapel charcoal cheese cherry chess chicken chimney chocolate church cider cinema circus citizen city
clarinet classroom cliff clinic clock closet cloud clover coach coast coconut coffee coin collar colony comet
compass concert cookie copper coral cotton couch cousin cowboy coyote crab cradle crane crayon creek cricket
crocodile crown crystal cucumber cupboard curtain cushion cyclone daisy dancer dentist desert desk diamond diary
dinner dinosaur doctor dolphin donkey door dragon drawer dress drum duck dungeon eagle earring easel eclipse elbow
elephant elevator emerald engine envelope eraser fabric factory falcon farmer faucet feather fence ferry festival
fiddle field finger fireplace flag flamingo flute forest fork fossil fountain frog fruit furnace galaxy garage
garden garlic gazelle gecko geyser ghost giraffe glacier glove goat goblet gondola goose gorilla grape grass guitar
hallway hammer hamster harbor harp hawk hedge helmet heron highway hill hippo hive hockey honey horizon horse
hospital hotel hurricane iceberg igloo insect island ivory jacket jaguar jeans jelly jewel journal jungle kangaroo
kayak kettle kitchen kite kitten knight koala ladder lagoon lake lamp lantern laptop lawyer leaf lemon leopard
letter lettuce library lighthouse lily lion lizard lobster locket lotus luggage magnet mailbox mango maple marble
market meadow medal melon meteor microscope mirror monkey moon mosquito motel mountain mouse muffin mushroom museum
napkin necklace needle nest newspaper noodle notebook nurse oasis ocean octopus olive onion orchard orchestra
ostrich otter oyster paddle pagoda painter palace pancake panda panther parrot pasta peach peacock peanut pear
pebble pelican pencil penguin pepper piano pickle picnic pigeon pillow pilot pineapple pizza planet plum pocket
poet pony popcorn potato pottery prairie pumpkin puppet puzzle pyramid quarry queen quill quilt rabbit raccoon
radio radish rainbow raisin ranch raven receipt reef rhino ribbon rice river robot rocket roof rooster ruby saddle
sailor salad salmon sandal sandwich satellite saucer sausage saxophone scarf scissors scooter sculpture shadow
shark sheep shell shield ship shoe shovel shrimp singer skeleton sled sloth snail snake soldier spider spinach
sponge spoon squirrel stadium statue stove strawberry submarine sugar suitcase sunflower swamp swan sweater table
teacher teapot telescope temple tent theater thimble thunder tiger toaster tomato tornado tortoise towel tower
tractor trumpet tulip tunnel turkey turtle umbrella unicorn uniform valley vase velvet village vinegar violin
volcano vulture waffle wagon walnut walrus wardrobe warrior waterfall whale wheat window wizard wolf yacht yogurt
zebra zipper ability absence accident advice anger anxiety argument beauty belief birth bottom breath business
chance choice comfort courage danger debt decision delight desire detail effort energy error evidence fact failure
faith fame fortune freedom friend future glory growth habit harmony health history honor humor idea image income
industry instinct journey justice kindness knowledge language laughter leader lesson liberty logic luck machine
manner memory method mission moment motion mystery nature network noise opinion origin pardon passion patience
peace people pleasure poem power praise pride problem purpose quality reason relief respect reward rhythm rumor
safety science sense silence skill society sorrow spirit storm story strength structure success summer theory
thought timber treasure trouble truth value victory vision voice weather winter wisdom worth youth autumn author
blueprint cargo chorus county customer district episode fabric garment harvest jury kingdom meal merchant mineral
monument neighbor novel ointment parcel pasture pilgrim pirate plaza portrait province puddle rattle recipe riddle
saint scholar season senate sheriff shepherd shrine sketch slipper spear stamp steam stream summit surgeon tavern
ticket tribe trophy tutor vapor verse vessel vineyard voyage widow yard
"""

ADJECTIVES = """
able absent active actual afraid agile alert alive ancient angry annual anxious arctic awake aware awful basic
bitter blank bland blind bold bored brave brief bright brisk broad broken bumpy busy calm careful casual cheap
cheerful chilly civil classic clean clever cloudy clumsy coarse cold common cosmic costly cozy crazy creamy crisp
crooked cruel curious curly cute damp daring dark dear deep dense direct dirty dizzy double dreamy dull dusty eager
early earnest easy elegant empty endless equal exact exotic faint fair false famous fancy fast fierce filthy final
fine firm flat fluffy foggy formal fragile frank free fresh friendly frozen full funny fuzzy gentle giant glad
global glossy golden graceful grand grateful greedy grumpy guilty happy hardy harsh hasty healthy heavy hidden high
hollow honest hostile huge humble hungry icy idle immense jolly juicy keen kind large lazy legal little lively
local lonely loose loud lovely loyal lucky lunar magic major mellow mighty mild minor misty modern modest moist
muddy narrow nasty native neat nervous noble noisy normal odd ordinary oval pale patient peaceful perfect plain
pleasant plump polite poor precious pretty proud public purple quick quiet rapid rare raw ready regular remote
rich rigid ripe rocky rough round royal rude rural rusty sacred salty sandy scary serene shaggy sharp shiny short
shy silent silky silly simple sleepy slim slow small smart smooth snowy soft solid sour spicy splendid spotted
stable steady steep sticky stiff stormy strange strict strong sturdy subtle sudden sunny super sweet swift tall
tender thick thin thirsty tidy tight tiny tough tranquil tricky tropical true ugly unique upset urban useful vacant
vague valid vast violet vivid warm weak wealthy weary wicked wide wild windy wise witty wooden woolly worried young
zealous absurd acidic adorable amber amused anxious bashful bleak blissful bouncy brittle bulky candid chubby
cosy crimson cunning dainty dazzling drowsy dusky feeble fiery frail frosty giddy gloomy gritty hefty hilarious
jagged jovial lanky lavish limp lumpy majestic meek merry nimble nutty obedient obvious pompous prickly puny quaint
radiant rowdy rugged rustic scrawny shabby shallow sloppy smoky soggy sparse spotless squeaky stale stubborn sullen
tangy tart tasty tedious thorny timid tired toxic trusty twisted vibrant wary whimsical wiry wobbly zany
"""

VERBS = """
accept achieve admire admit adopt advise afford agree allow amuse announce annoy appear applaud arrange arrive
attach attack attend avoid bake bathe battle behave belong blink boast boil borrow bounce breathe bring brush
build bury calculate celebrate challenge charge chase cheer chew choke chop clap climb close collect comb command
compare compete complain concentrate confess connect consider contain continue copy correct cough count crack crawl
create cross crush cure curl dance decide decorate delay deliver depend describe deserve destroy develop disagree
discover divide drag drain drink drive earn educate embrace employ enjoy enter escape examine excite excuse
exercise exist expand expect explain explode explore extend fade fasten fetch fight fill find fold follow forgive
frighten gather gaze glow grab greet grin grip groan guard guess guide handle hang happen harm hate haunt heal hike
hover hug hunt hurry identify ignore imagine impress improve include inform injure inspect instruct intend
interrupt introduce invent invite itch jog juggle jump kick kneel knit knock label laugh launch learn lick lift
listen load lock manage march marry measure melt memorize mend moan mourn multiply murmur notice obey observe obtain
occur offend offer organize overflow pack paint paste pause peck pedal peel perform permit pinch plant please plug
poke polish pour pray preach prefer prepare present preserve pretend print produce promise protect provide pull
pump punch punish push quit race raise reach realize receive recognize reduce reflect refuse regret reign reject
rejoice relax release remain remember remind remove repair repeat replace reply report rescue retire rhyme rinse
risk roar ruin rush sail satisfy scatter scold scorch scrape scratch scream scribble search select sell settle
shave shelter shiver shock shrug sigh sing sink sip skip slap sleep slide smash smell smile snatch sneeze sniff
snore soak solve soothe spark sparkle spell spill spin spoil spray sprout squeak squeal squeeze stain stare steer
stir stitch strengthen stretch stroke subtract succeed suffer suggest supply support suppose surround suspect
suspend swallow sway swim swing talk taste teach tease tempt terrify thank thaw think throw tickle toss touch trace
trade transport travel treat tremble trot trust tumble twist unfasten unite unlock unpack vanish visit wail wander
warn wash waste watch weigh welcome whine whirl whisper wink wipe wobble wrap wreck wrestle wriggle write yawn yell
"""


@cache
def key_words() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(adjectives, nouns) for keys such as "misty-lantern" (RULER's `words` needle keys)."""
    return tuple(sorted(set(ADJECTIVES.split()))), tuple(sorted(set(NOUNS.split())))


@cache
def list_words() -> tuple[str, ...]:
    """Nouns, adjectives and verbs for the cwe word lists, minus words inside another word ("rain" in "train"):
    answers are scored by substring match, so a shorter word must not be found inside a longer one."""
    words = sorted(set((NOUNS + ADJECTIVES + VERBS).split()))
    return tuple(w for w in words if not any(w != other and w in other for other in words))
