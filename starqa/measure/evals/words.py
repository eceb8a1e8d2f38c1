"""Word lists for the evaluation tasks: needle keys (adjective-noun pairs), word values and
the common-word lists. Disjoint lists, lowercase, no word inside another of the same list."""

ADJECTIVES: tuple[str, ...] = tuple("""
abundant agile amber ancient anxious arctic bashful bitter blazing bold brave breezy brisk
bronze calm candid careful cheerful chilly clever cloudy coastal cosmic cozy crimson crisp
curious daring dusty eager early earnest electric elegant emerald fancy fearless feathered
fierce fluffy foggy fragrant frosty gentle giant gilded glad golden graceful grumpy hidden
humble icy jolly keen lively lonely lucky mellow merry misty modest mossy narrow nimble
noble patient plucky polite proud quiet rapid restless rocky rosy rusty sandy scarlet shy
silent silver sleepy slender smooth snowy solemn sturdy sunny swift tender tidy velvet
vivid wandering windy witty young zealous dapper fuzzy jagged spotted striped dainty
""".split())

NOUNS: tuple[str, ...] = tuple("""
acorn anchor anvil apron arrow badger balcony banner barrel basket beacon beetle blanket
bonnet boulder bracelet bramble bucket buffalo button cabin cactus candle canoe canyon
carpet castle cellar chimney cinder clover cobweb compass copper cottage cradle crayon
crystal cushion dagger dolphin donkey dragon eagle easel ember falcon feather fiddle
forest fountain garden garnet glacier goblet gravel hammer harbor harvest hazel helmet
hermit honey horizon jacket jasmine kettle kitten ladder lantern lemon lizard locket
magnet maple marble meadow mirror mitten monkey needle nugget orchid otter paddle pebble
pepper pillow pirate planet pocket puddle pumpkin quill rabbit raven ribbon river robin
rocket saddle sailor satchel shadow shovel signal sparrow spider squirrel stable statue
teapot thimble thistle thunder tiger timber tractor trumpet tulip turnip umbrella valley
violet wagon walnut whistle willow window wizard zebra banjo biscuit blossom bottle
cricket gadget giraffe hamster igloo jigsaw kayak koala lobster mango muffin nectar
oyster parrot peanut penguin pickle puffin quartz radish salmon sponge tadpole toffee
volcano waffle walrus yacht
""".split())

# Values of word needles: never keys, and absent from the prose and the noise.
VALUE_WORDS: tuple[str, ...] = tuple("""
aardvark abacus accordion alpaca anemone armadillo artichoke asparagus avalanche baboon
bagpipe barnacle bellows blimp boomerang bugle burrito capybara caramel cauldron
chameleon chandelier chipmunk cinnamon clarinet coconut croissant cymbal dandelion
dinosaur dumpling eggplant escalator flamingo gazelle gondola gorilla harmonica hedgehog
iguana jellyfish kangaroo lasagna lemur limousine macaroni mandolin marmalade meerkat
mongoose mosquito narwhal nutmeg octopus omelette ostrich pancake panther papaya pelican
platypus porcupine pretzel quokka raccoon saxophone scooter seahorse spaghetti starfish
submarine tambourine toucan trombone ukulele vulture wombat xylophone zeppelin zucchini
""".split())
